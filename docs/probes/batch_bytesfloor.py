# RTT of a plain uvloop socket pair: request of X bytes, reply of X bytes (server on CPU 0, client on CPU 1)
import os, sys, time, asyncio, socket, uvloop, statistics
X = [4096 + 64, 32 * 4096 + 600, 128 * 4096 + 2000, 64, 32*4+600]
def server(sock):
    os.sched_setaffinity(0, {0})
    async def main():
        class P(asyncio.BufferedProtocol):
            def connection_made(self, t):
                self.t = t; self.buf = bytearray(1 << 21); self.v = memoryview(self.buf); self.n = 0; self.want = None
                t.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            def get_buffer(self, h): return self.v[self.n:]
            def buffer_updated(self, k):
                self.n += k
                while True:
                    if self.want is None:
                        if self.n < 4: return
                        self.want = int.from_bytes(self.buf[:4], "little")
                    if self.n < 4 + self.want: return
                    self.t.write(bytes(self.want))
                    rest = self.n - 4 - self.want
                    self.buf[:rest] = self.buf[4 + self.want:self.n]; self.n = rest; self.want = None
        srv = await asyncio.get_running_loop().create_server(P, sock=sock)
        await asyncio.sleep(1e9)
    uvloop.run(main())
s = socket.socket(); s.bind(("127.0.0.1", 0)); s.listen(); port = s.getsockname()[1]
pid = os.fork()
if pid == 0:
    server(s); os._exit(0)
os.sched_setaffinity(0, {1})
async def main():
    r, w = await asyncio.open_connection("127.0.0.1", port)
    w.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    for x in X:
        msg = x.to_bytes(4, "little") + bytes(x)
        ts = []
        for i in range(3000):
            t0 = time.perf_counter(); w.write(msg); await r.readexactly(x); ts.append(time.perf_counter() - t0)
        print(f"{x:7d} B each way: p50 {statistics.median(ts[500:])*1e6:.1f} us")
uvloop.run(main())
os.kill(pid, 9)
