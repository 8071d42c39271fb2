#!/usr/bin/env python3
"""Raw TCP bandwidth over loopback: the ceiling for `oxccl perf` forced through NET/Socket on one
machine (issue 6 asks for it next to the NET ratios). N parallel streams, each a connected pair
of sockets; one thread sends `--mib` MiB per stream in `--chunk` KiB writes, one receives it.

    python3 tools/loopback_bw.py --streams 1 4 16 --mib 2048

Prints one line per stream count: total GB/s (1e9 bytes/s) over the slowest stream's time.
"""
import argparse
import socket
import threading
import time


def run(streams: int, total_mib: int, chunk_kib: int) -> float:
    per = total_mib * (1 << 20) // streams
    buf = bytearray(chunk_kib << 10)
    lst = socket.socket()
    lst.bind(("127.0.0.1", 0))
    lst.listen(streams)
    port = lst.getsockname()[1]
    pairs = []
    for _ in range(streams):
        c = socket.create_connection(("127.0.0.1", port))
        s, _ = lst.accept()
        pairs.append((c, s))
    lst.close()
    start = threading.Barrier(2 * streams + 1)

    def send(sock):
        view = memoryview(buf)
        start.wait()
        left = per
        while left > 0:
            n = min(left, len(view))
            sock.sendall(view[:n])
            left -= n

    def recv(sock):
        rbuf = bytearray(len(buf))
        view = memoryview(rbuf)
        start.wait()
        left = per
        while left > 0:
            n = sock.recv_into(view, min(left, len(view)))
            if n == 0:
                raise RuntimeError("peer closed early")
            left -= n

    threads = [threading.Thread(target=f, args=(p[i],)) for p in pairs for i, f in ((0, send), (1, recv))]
    for t in threads:
        t.start()
    start.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    dt = time.perf_counter() - t0
    for c, s in pairs:
        c.close()
        s.close()
    return per * streams / dt / 1e9


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--streams", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--mib", type=int, default=2048, help="MiB sent in total per measurement")
    ap.add_argument("--chunk", type=int, default=4096, help="KiB per send call")
    a = ap.parse_args()
    for n in a.streams:
        if n < 1:
            ap.error(f"--streams {n} is out of range (accepted: >= 1)")
        print(f"loopback TCP: {n:3d} stream(s), {a.mib} MiB, {a.chunk} KiB writes: {run(n, a.mib, a.chunk):6.2f} GB/s", flush=True)


if __name__ == "__main__":
    main()
