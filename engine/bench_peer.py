"""`ds4-bench --peer NAME`: a second backend measured in the same run, over the same tokens and
frontiers, and each row's ratio against it; and what the bench says about where a backend ran
(its device, the process's memory), so figures from two backends are read side by side honestly.
"""
from __future__ import annotations

import gc
import platform
import resource
import sys

from .options import EngineOptions


def peer_options(options: EngineOptions, peer: str | None) -> EngineOptions | None:
    """The peer's options: the measured backend's numerics, paging and threads, the peer's name.
    Raises ValueError (one line) for a peer that cannot serve here or is the measured backend."""
    if peer is None:
        return None
    from .backends import registry
    mine = registry.pick(options.backend).name
    theirs = registry.pick(peer).name          # an unknown or unavailable name: BackendError, one line
    if theirs == mine:
        raise ValueError(f"--peer {peer} is the backend being measured ({mine}); name another one")
    o = EngineOptions(backend=theirs, numerics=options.numerics, paging=options.paging,
                      threads=options.threads)
    o.check()
    return o


def device_line(eng) -> str:
    """Where the engine's arithmetic runs. For mlx: MLX's default device (mx.default_device())
    and whether the Metal kernels are in use; off Apple Silicon MLX has only its CPU device."""
    ops = eng.model.ops
    if eng.backend == "mlx":
        import mlx.core as mx
        dev = mx.default_device()
        metal = getattr(ops, "metal", None) is not None
        line = f"device: mlx {mx.__version__} on {dev}, Metal kernels {'on' if metal else 'off'}"
        if dev.type == mx.DeviceType.cpu:
            where = ("on Linux MLX has no GPU" if platform.system() == "Linux"
                     else "MLX's default device here is its CPU")
            line += f" ({where}: these are CPU figures)"
        return line
    if eng.backend == "cupy":
        return "device: " + ops.device_line()
    if eng.backend == "cpu":
        from .backends.cpu import kernels
        return f"device: cpu, the C kernels on {kernels.get_threads()} thread(s)"
    return f"device: {eng.backend} on the host ({platform.machine() or 'unknown machine'})"


def release_memory() -> None:
    """Between two backends in one process: collect the closed engine (its weights may sit in
    reference cycles) and hand MLX's buffer cache back to the system, which MLX keeps for reuse
    by later MLX arrays, not for the peer's NumPy memory."""
    gc.collect()
    mx = sys.modules.get("mlx.core")
    if mx is not None:
        mx.clear_cache()


def rss_bytes() -> tuple[int, str]:
    """The process's resident memory now (Linux: VmRSS), else its peak (getrusage), and which."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024, "rss"
    except OSError:
        pass
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak * (1 if sys.platform == "darwin" else 1024), "peak rss"   # macOS counts bytes, Linux KiB


def ratio_lines(name: str, rows: list[dict], probes, peer: str, peer_rows: list[dict], peer_probes) -> list[str]:
    """One line per frontier: this backend's prefill and decode t/s over the peer's, and how many
    greedy probe tokens the two decoded alike before they first differ (a backend that rounds
    differently may pick another token, and from there each continues its own text)."""
    out = []
    for r, q, p, pp in zip(rows, peer_rows, probes, peer_probes):
        same = next((i for i, (x, y) in enumerate(zip(p, pp)) if x != y), min(len(p), len(pp)))
        out.append(f"ctx {r['ctx_tokens']}: {name}/{peer} prefill {r['prefill_tps'] / max(q['prefill_tps'], 1e-9):.2f}x "
                   f"({r['prefill_tps']:.2f} vs {q['prefill_tps']:.2f} t/s), decode "
                   f"{r['gen_tps'] / max(q['gen_tps'], 1e-9):.2f}x ({r['gen_tps']:.2f} vs {q['gen_tps']:.2f} t/s); "
                   f"greedy probe alike for {same} of {len(p)} tokens")
    return out
