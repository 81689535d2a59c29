"""gpubroker: leases on GPU memory, whole GPUs, CPU cores and host memory, brokered per machine."""

__version__ = "0.3.0"
