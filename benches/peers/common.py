"""Shared by the peer benchmarks: CUDA-event timing like the Rust benches, JSON lines."""
import json
import statistics

import torch


def time_ms(fn):
    """Median ms per call: warm-up, then 15 samples of enough calls to last ~2 ms each."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    fn()
    b.record()
    b.synchronize()
    reps = max(1, min(200, int(2.0 / max(a.elapsed_time(b), 1e-3) + 0.999)))
    samples = []
    for _ in range(15):
        a.record()
        for _ in range(reps):
            fn()
        b.record()
        b.synchronize()
        samples.append(a.elapsed_time(b) / reps)
    return statistics.median(samples)


def time_graphed(fn):
    """(ms, eager ms): `fn` replayed from a CUDA graph, so that the peer is timed without
    Python's launch overhead; the eager time when capture fails (ms equals it then)."""
    eager = time_ms(fn)
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):
                fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        return time_ms(graph.replay), eager
    except Exception as e:  # capture unsupported for this op / torch: eager only, said once
        print(f"graph capture failed ({type(e).__name__}: {str(e)[:120]}); eager timing", flush=True)
        torch.cuda.synchronize()
        return eager, eager


def emit(path, **row):
    print(json.dumps(row), flush=True)
    if path:
        with open(path, "a") as f:
            f.write(json.dumps(row) + "\n")
