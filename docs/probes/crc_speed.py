import time, os, sys
import crc32c
from awscrt import checksums
N = 1 << 30
buf = bytearray(os.urandom(16<<20)) * 64  # 1 GiB
mv = memoryview(buf)
part = 16 << 20
def run(fn, name, sl):
    t = time.perf_counter(); v = 0
    for off in range(0, N, sl):
        v = fn(mv[off:off+sl], v)
    dt = time.perf_counter() - t
    print(f"{name} slice={sl>>10}KiB {dt*1000:.1f} ms/GiB value={v:#x}")
    return v
a = run(crc32c.crc32c, "crc32c", part)
b = run(checksums.crc32c, "awscrt", part)
assert a == b, (a, b)
run(checksums.crc32c, "awscrt", 1<<20)
run(checksums.crc32c, "awscrt", 4<<10)
run(crc32c.crc32c, "crc32c", 4<<10)
# hot: same 1 MiB repeatedly
small = memoryview(buf)[:1<<20]
for fn, name in ((crc32c.crc32c, "crc32c"), (checksums.crc32c, "awscrt")):
    t = time.perf_counter()
    for _ in range(1024): fn(small, 0)
    print(name, "hot 1MiB x1024", f"{(time.perf_counter()-t)*1000:.1f} ms/GiB")
print(checksums.crc32c(b"123456789"), crc32c.crc32c(b"123456789"), hex(checksums.crc32c(b"123456789")))
