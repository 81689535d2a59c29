from conftest import BrokerProcess


def test_a_broker_process_reports_its_simulated_gpu(broker_process: type[BrokerProcess]) -> None:
    broker = broker_process("1x24GiB").start()
    node = broker.client().call("GET", "/v1/node")
    assert [g["uuid"] for g in node["gpus"]] == ["GPU-sim-0"]
    assert node["gpus"][0]["figures"]["total"] == 24 * 2**30
