"""PyTorch through oxccl's libnccl.so.2: every call ProcessGroupNCCL makes for the common
collectives, a few DDP steps, a CUDA-graph capture, checked against exact values.

Run by run.sh (two processes, both ranks on GPU 0 unless two GPUs exist):

    python3 check.py BACKEND OUTDIR      BACKEND = nccl | gloo

Each rank writes OUTDIR/rank<R>.json: the library's version as torch sees it, a pass/fail
line per call (expected values are closed forms of exactly representable inputs), the DDP
model's parameters after the training steps (their SHA-256 over the raw float32 bytes), and
what the graph capture did. run.sh compares the nccl run's parameters with the gloo run's.
"""
import hashlib
import json
import os
import sys
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

WORLD = 2
STEPS = 5


def device_for(rank):
    n = torch.cuda.device_count()
    return torch.device("cuda", rank % n)


def checks(rank, dev, model_dev, backend):
    """Every call on tensors of `dev`; the DDP model on `model_dev` (the gloo reference keeps
    the calls on CPU tensors, which gloo serves for every call, and trains the model on the
    same GPU as the nccl run, so the two runs' parameters can be compared bit for bit)."""
    out = {}

    def check(name, fn):
        try:
            ok, detail = fn()
            out[name] = "ok" if ok else f"WRONG: {detail}"
        except Exception as e:  # a refused call is reported, the run goes on
            out[name] = f"ERROR: {type(e).__name__}: {str(e).splitlines()[0][:300]}"

    n = 1 << 20  # elements, float32 (4 MiB): every value an exact integer

    def all_reduce(op, expect):
        def run():
            x = torch.arange(n, device=dev, dtype=torch.float32) + rank
            dist.all_reduce(x, op=op)
            e = expect(torch.arange(n, device=dev, dtype=torch.float32))
            return torch.equal(x, e), f"first {x[:4].tolist()} want {e[:4].tolist()}"
        return run

    check("all_reduce_sum", all_reduce(dist.ReduceOp.SUM, lambda a: 2 * a + 1))
    if backend == "nccl":
        check("all_reduce_avg", all_reduce(dist.ReduceOp.AVG, lambda a: a + 0.5))
    check("all_reduce_max", all_reduce(dist.ReduceOp.MAX, lambda a: a + 1))

    def broadcast():
        x = torch.full((n,), float(rank + 7), device=dev)
        dist.broadcast(x, src=1)
        return torch.equal(x, torch.full_like(x, 8.0)), f"got {x[:2].tolist()}"
    check("broadcast_root_1", broadcast)

    def all_gather():
        x = torch.full((n,), float(rank + 1), device=dev)
        y = torch.zeros(WORLD * n, device=dev)
        dist.all_gather_into_tensor(y, x)
        e = torch.cat([torch.full((n,), float(r + 1), device=dev) for r in range(WORLD)])
        return torch.equal(y, e), f"got {y[::n].tolist()}"
    check("all_gather_into_tensor", all_gather)

    def reduce_scatter():
        x = torch.arange(WORLD * n, device=dev, dtype=torch.float32) * (rank + 1)
        y = torch.zeros(n, device=dev)
        dist.reduce_scatter_tensor(y, x)
        e = 3 * torch.arange(rank * n, (rank + 1) * n, device=dev, dtype=torch.float32)
        return torch.equal(y, e), f"got {y[:3].tolist()} want {e[:3].tolist()}"
    if backend == "nccl":
        check("reduce_scatter_tensor", reduce_scatter)

    def all_to_all():
        x = torch.arange(WORLD * 1000, device=dev, dtype=torch.float32) + 10000 * rank
        y = torch.empty_like(x)
        dist.all_to_all_single(y, x)
        e = torch.cat([torch.arange(rank * 1000, (rank + 1) * 1000, device=dev,
                                    dtype=torch.float32) + 10000 * r for r in range(WORLD)])
        return torch.equal(y, e), f"got {y[::1000].tolist()} want {e[::1000].tolist()}"
    check("all_to_all_single", all_to_all)

    def send_recv():
        peer = 1 - rank
        if rank == 0:
            dist.send(torch.arange(4096, device=dev, dtype=torch.float32), dst=peer)
            y = torch.zeros(4096, device=dev)
            dist.recv(y, src=peer)
            e = torch.arange(4096, device=dev, dtype=torch.float32) * 2
        else:
            y = torch.zeros(4096, device=dev)
            dist.recv(y, src=peer)
            dist.send(y * 2, dst=peer)
            e = torch.arange(4096, device=dev, dtype=torch.float32)
        return torch.equal(y, e), f"got {y[:3].tolist()}"
    check("send_recv", send_recv)

    def batch_p2p():
        peer = 1 - rank
        x = torch.full((65536,), float(rank + 1), device=dev)
        y = torch.zeros(65536, device=dev)
        reqs = dist.batch_isend_irecv([dist.P2POp(dist.isend, x, peer),
                                       dist.P2POp(dist.irecv, y, peer)])
        for r in reqs:
            r.wait()
        return torch.equal(y, torch.full_like(y, float(peer + 1))), f"got {y[:2].tolist()}"
    check("batch_isend_irecv", batch_p2p)

    check("barrier", lambda: (dist.barrier() is None, ""))

    def new_group():
        g = dist.new_group([0, 1])
        x = torch.ones(1000, device=dev) * (rank + 1)
        dist.all_reduce(x, group=g)
        ok = torch.equal(x, torch.full_like(x, 3.0))
        dist.destroy_process_group(g)
        return ok, f"got {x[:2].tolist()}"
    check("new_group_all_reduce", new_group)

    def ddp():
        torch.manual_seed(1234)
        model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(),
                                    torch.nn.Linear(128, 8)).to(model_dev)
        ddp = torch.nn.parallel.DistributedDataParallel(
            model, device_ids=[model_dev.index] if model_dev.type == "cuda" else None)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
        g = torch.Generator().manual_seed(99 + rank)
        for _ in range(STEPS):
            x = torch.randn(32, 64, generator=g).to(model_dev)
            t = torch.randn(32, 8, generator=g).to(model_dev)
            opt.zero_grad()
            torch.nn.functional.mse_loss(ddp(x), t).backward()
            opt.step()
        h = hashlib.sha256()
        for p in model.parameters():
            h.update(p.detach().cpu().numpy().tobytes())
        out["ddp_params_sha256"] = h.hexdigest()
        return True, ""
    check("ddp_steps", ddp)

    def graph():
        if dev.type != "cuda":
            return True, "skipped on CPU"
        x = torch.ones(1024, device=dev) * (rank + 1)
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            dist.all_reduce(x)  # warm-up outside the capture
        torch.cuda.current_stream().wait_stream(s)
        torch.cuda.synchronize()
        x.fill_(rank + 1)
        gr = torch.cuda.CUDAGraph()
        with torch.cuda.graph(gr):
            dist.all_reduce(x)
        x.fill_(rank + 1)
        gr.replay()
        torch.cuda.synchronize()
        return torch.equal(x, torch.full_like(x, 3.0)), f"replayed: {x[:2].tolist()}"
    if backend == "nccl":
        check("cuda_graph_all_reduce", graph)
    return out


def worker(rank, backend, outdir):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("MASTER_PORT", "29533"))
    result = {"rank": rank, "backend": backend}
    try:
        if backend == "nccl":
            dev = model_dev = device_for(rank)
            torch.cuda.set_device(dev)
            dist.init_process_group("nccl", rank=rank, world_size=WORLD, device_id=dev)
            # The library that serves the calls, as it reports itself (oxccl says 2.28.3, the
            # ABI it implements; PyTorch's own NCCL is 2.28.9).
            result["nccl_version"] = ".".join(map(str, torch.cuda.nccl.version()))
            with open("/proc/self/maps") as maps:
                result["libnccl_loaded"] = sorted({l.split()[-1] for l in maps if "libnccl" in l})
        else:
            dev = torch.device("cpu")
            model_dev = device_for(rank) if torch.cuda.is_available() else dev
            dist.init_process_group("gloo", rank=rank, world_size=WORLD)
        result["checks"] = checks(rank, dev, model_dev, backend)
        result["ddp_params_sha256"] = result["checks"].pop("ddp_params_sha256", None)
        dist.destroy_process_group()
        result["destroyed"] = True
    except Exception:
        result["fatal"] = traceback.format_exc()[-2000:]
    with open(os.path.join(outdir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    backend, outdir = sys.argv[1], sys.argv[2]
    os.makedirs(outdir, exist_ok=True)
    mp.spawn(worker, args=(backend, outdir), nprocs=WORLD, join=True)
