"""KV transfer benchmark: Tandem's gRPC KV pull against a raw loopback TCP socket, same bytes, same run.

    python bench/kv_transfer.py [--quick] [--sizes-mb 1,4,16,64,256] [--reps 5]

The sending side runs in a child process pinned to CPU 0 (where a prefill pod runs), the pulling
side in this process pinned to CPU 1 (the decode pod's CPU):
  * gRPC: the real `KVTransferServicer` (prefill_svc/service.py, registered with its
    `add_to_server`) over a real `KVStore` on a real gRPC aio server on loopback, pulled with the
    real `KVPuller` (decode_svc/puller.py): chunked at the prefill pod's default `kv_chunk_bytes`,
    a running CRC32 checked per chunk (the last one is the whole payload's), capability check,
    reassembled into host numpy arrays;
  * raw socket: the same K and V bytes written with one `sendall` per array on a loopback TCP
    connection and read with `recv_into` a buffer allocated as the gRPC decoder allocates its
    own (`np.empty`: the same page faults, huge pages when the kernel has them), then viewed as
    the same numpy arrays: no framing, no checksum, no copies beyond the kernel's. The floor of
    any transport.
Each pull is timed from the request to the arrays on the host (median of --reps). Writes its
section of bench/RESULTS.md and `kv_pull_vs_raw_socket_bytes_per_s` (at the largest size) in
bench/out/summary.json. Timings are reported, never asserted.
"""
from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import socket
import statistics
import struct
import sys
import threading
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.common import fmt, machine_info, machine_line, markdown_table, merge_summary, write_section

SECTION = "kv"
MB = 1 << 20
LAYOUT = (4, 4, 64)  # layers, kv heads, head dim: a payload of S bytes has S / 8192 positions (float32)
SENDER_CPUS, PULLER_CPUS = {0}, {1}


def make_payload(nbytes: int, seed: int = 0):
    from tandem_core.types import KVPayload

    layers, heads, hd = LAYOUT
    length = max(1, nbytes // (2 * 4 * layers * heads * hd))
    rng = np.random.default_rng(seed)
    shape = (layers, length, heads, hd)
    k = rng.standard_normal(shape, dtype=np.float32)
    return KVPayload(k, -k, true_length=length, first_token=7)


# ---------------------------------------------------------------------------------------------
# the sending side (child process)


def _raw_server(sock: socket.socket, payloads: dict[int, object]) -> None:
    """Per connection: read an 8-byte size, send that payload's K then V bytes."""
    while True:
        conn, _ = sock.accept()
        with conn:
            (size,) = struct.unpack("!Q", conn.recv(8, socket.MSG_WAITALL))
            p = payloads[size]
            conn.sendall(memoryview(p.k).cast("B"))
            conn.sendall(memoryview(p.v).cast("B"))


async def _sender_main(sizes: list[int], pipe) -> None:
    from prefill_svc.kv_store import KVStore
    from prefill_svc.service import KVTransferServicer
    from prefill_svc.settings import PrefillSettings
    from tandem_core import grpc_util

    s = PrefillSettings()
    payloads = {n: make_payload(n) for n in sizes}
    store = KVStore(budget_bytes=2 * max(sizes) + MB, lease_s=600)
    server = grpc_util.make_server(s.grpc.max_message_bytes)
    KVTransferServicer(store, s.kv_chunk_bytes, lambda _r: None).add_to_server(server)
    port = grpc_util.bind(server, "127.0.0.1", 0)
    await server.start()
    raw = socket.create_server(("127.0.0.1", 0))
    threading.Thread(target=_raw_server, args=(raw, payloads), daemon=True).start()
    pipe.send((port, raw.getsockname()[1], s.kv_chunk_bytes, s.grpc.max_message_bytes))
    loop = asyncio.get_running_loop()
    while True:  # commands: ("put", request_id, size) -> capability; ("cpu",) -> CPU s; ("stop",)
        cmd = await loop.run_in_executor(None, pipe.recv)
        if cmd[0] == "stop":
            break
        if cmd[0] == "cpu":
            pipe.send(time.process_time())
            continue
        held = store.put(cmd[1], payloads[cmd[2]])
        pipe.send(held.capability)
    await server.stop(None)


def sender(sizes: list[int], pipe) -> None:
    os.sched_setaffinity(0, SENDER_CPUS)
    asyncio.run(_sender_main(sizes, pipe))


# ---------------------------------------------------------------------------------------------
# the pulling side (this process)


def raw_pull(port: int, size: int, like) -> tuple[np.ndarray, np.ndarray]:
    buf = np.empty(like.nbytes, np.uint8)  # allocated like the gRPC decoder's buffer (same page faults)
    view = memoryview(buf)
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 * MB)
        s.sendall(struct.pack("!Q", size))
        got = 0
        while got < len(buf):
            n = s.recv_into(view[got:], len(buf) - got)
            if n == 0:
                raise ConnectionError("raw sender closed early")
            got += n
    half = like.k.nbytes
    k = np.frombuffer(buf, np.float32, count=half // 4).reshape(like.k.shape)
    v = np.frombuffer(buf, np.float32, offset=half).reshape(like.v.shape)
    return k, v


async def grpc_pull(puller, pipe, port: int, size: int, rid: str):
    from tandem_core.bus.ready import ReadyNotice
    from tandem_core.types import GenerationRequest

    pipe.send(("put", rid, size))
    cap = pipe.recv()
    notice = ReadyNotice(GenerationRequest(rid, [1], 2), f"127.0.0.1:{port}", cap, 0, "bench", 7)
    pipe.send(("cpu",))
    s0, c0, t0 = pipe.recv(), time.process_time(), time.perf_counter()
    payload = await puller.pull(notice, timeout_s=120)
    dt, cpu = time.perf_counter() - t0, time.process_time() - c0
    pipe.send(("cpu",))
    return dt, {"client": cpu, "server": pipe.recv() - s0}, payload


async def measure(sizes: list[int], reps: int) -> list[dict]:
    from decode_svc.puller import KVPuller

    ctx = mp.get_context("spawn")
    ours, theirs = ctx.Pipe()
    child = ctx.Process(target=sender, args=(sizes, theirs), daemon=True)
    child.start()
    gport, rport, chunk, max_msg = ours.recv()
    puller = KVPuller(max_msg)
    rows = []
    try:
        for size in sizes:
            like = make_payload(size)
            g_t, r_t, g_cpu, r_cpu = [], [], [], []
            # Warm-ups: 3 before the first size (channel, HTTP/2 windows, code paths), then 1 per size
            # (page faults); small payloads get at least 9 timed pulls (a few ms each, noisy).
            warm = 3 if size == sizes[0] else 1
            timed = reps if size >= 64 * MB else max(reps, 9)
            for i in range(warm + timed):
                dt, cpu, got = await grpc_pull(puller, ours, gport, size, f"r{size}-{i}")
                assert got.nbytes == like.nbytes and np.array_equal(got.k[:1, :1], like.k[:1, :1])
                c0, t0 = time.process_time(), time.perf_counter()
                k, _v = raw_pull(rport, size, like)
                r_dt, r_c = time.perf_counter() - t0, time.process_time() - c0
                assert np.array_equal(k[:1, :1], like.k[:1, :1])
                if i >= warm:
                    g_t.append(dt)
                    r_t.append(r_dt)
                    g_cpu.append(cpu)
                    r_cpu.append(r_c)
            g, r = statistics.median(g_t), statistics.median(r_t)
            rows.append({"bytes": like.nbytes, "grpc_s": g, "raw_s": r, "grpc_bytes_per_s": like.nbytes / g,
                         "raw_bytes_per_s": like.nbytes / r, "ratio": r / g, "chunk_bytes": chunk,
                         "grpc_client_cpu_s": statistics.median(c["client"] for c in g_cpu),
                         "grpc_server_cpu_s": statistics.median(c["server"] for c in g_cpu),
                         "raw_client_cpu_s": statistics.median(r_cpu)})
            print(_progress(rows[-1]), flush=True)
    finally:
        ours.send(("stop",))
        child.join(10)
        if child.is_alive():
            child.kill()
        await puller.close()
    return rows


def _progress(r: dict) -> str:
    return (f"{r['bytes'] / MB:7.1f} MB  gRPC {r['grpc_bytes_per_s'] / MB:8.0f} MB/s"
            f"  raw {r['raw_bytes_per_s'] / MB:8.0f} MB/s"
            f"  ratio {r['ratio']:.2f}  CPU ms puller {r['grpc_client_cpu_s'] * 1e3:.1f}"
            f" sender {r['grpc_server_cpu_s'] * 1e3:.1f} raw {r['raw_client_cpu_s'] * 1e3:.1f}")


def report(rows: list[dict], argv: list[str], machine: dict) -> str:
    table = markdown_table(
        ["payload MB", "gRPC pull ms", "gRPC MB/s", "raw socket ms", "raw MB/s", "gRPC / raw",
         "gRPC puller CPU ms", "gRPC sender CPU ms", "raw puller CPU ms"],
        [[r["bytes"] / MB, r["grpc_s"] * 1e3, r["grpc_bytes_per_s"] / MB, r["raw_s"] * 1e3,
          r["raw_bytes_per_s"] / MB, r["ratio"], r["grpc_client_cpu_s"] * 1e3, r["grpc_server_cpu_s"] * 1e3,
          r["raw_client_cpu_s"] * 1e3] for r in rows])
    return "\n".join([
        "## KV transfer: gRPC pull vs a raw loopback socket", "",
        f"Command: `python bench/kv_transfer.py {' '.join(argv)}`. Machine: {machine_line(machine)}.",
        "Sender (the real `KVTransferServicer` + `KVStore` on a gRPC aio server, and a raw TCP sender) in a "
        "child process on CPU 0; puller (the real `KVPuller`, and a `recv_into` loop into an `np.empty` buffer "
        "allocated like the decoder's) in the parent on CPU 1; "
        f"loopback; chunk {fmt(rows[0]['chunk_bytes'] // 1024)} KiB, a running CRC32 checked per chunk (the "
        "last one is the whole payload's); time from the request to "
        "numpy arrays on the host, median of the timed repetitions (at least 9 below 64 MB). CPU ms: process CPU time (all threads) "
        "of the puller and of the gRPC sender during one pull; on a loaded machine they are steadier than "
        "wall times.", "",
        table, "",
        f"`kv_pull_vs_raw_socket_bytes_per_s` = {fmt(rows[-1]['ratio'])} at {rows[-1]['bytes'] / MB:.0f} MB "
        "(target >= 0.5).",
    ])


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="1, 16 and 256 MB, 3 repetitions")
    p.add_argument("--sizes-mb", default="")
    p.add_argument("--reps", type=int, default=0)
    p.add_argument("--no-write", action="store_true")
    a = p.parse_args(argv)
    sizes_mb = [float(x) for x in a.sizes_mb.split(",")] if a.sizes_mb else (
        [1, 16, 256] if a.quick else [1, 4, 16, 64, 256])
    reps = a.reps or (3 if a.quick else 5)
    os.sched_setaffinity(0, PULLER_CPUS)
    rows = asyncio.run(measure([int(m * MB) for m in sizes_mb], reps))
    md = report(rows, argv, machine_info())
    print(md)
    if not a.no_write:
        write_section(SECTION, md)
        merge_summary({"kv_pull_vs_raw_socket_bytes_per_s": rows[-1]["ratio"],
                       "kv_pull_vs_raw_socket_bytes_per_s_1mb": rows[0]["ratio"]})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
