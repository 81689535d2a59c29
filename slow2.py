import socket, time, sys, subprocess
port=int(sys.argv[1]); n=int(sys.argv[2])
socks=[]
for i in range(n):
    s=socket.create_connection(("127.0.0.1",port)); s.sendall(b"GET /v1/node HTTP/1.1\r\nHost: 127.0.0.1\r\nX-a: "); socks.append(s)
time.sleep(1)
print(subprocess.run(["curl","-s","-m","3","-w"," %{http_code}",f"http://127.0.0.1:{port}/healthz"],capture_output=True,text=True).stdout)
print(subprocess.run(["curl","-s","-m","3","-w"," %{http_code}","-X","POST","-d",'{"cpu_cores":1}',f"http://127.0.0.1:{port}/v1/leases"],capture_output=True,text=True).stdout[:200])
time.sleep(float(sys.argv[3]))
print(subprocess.run(["curl","-s","-m","3","-w"," %{http_code}",f"http://127.0.0.1:{port}/healthz"],capture_output=True,text=True).stdout)
