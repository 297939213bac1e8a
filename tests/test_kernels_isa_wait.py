"""Choosing the cpu kernels' build, OpenMP's wait policy (issue 36), and the F16 matvec in ds4's order (issue 33).

* kernels.set_isa / DS4_CPU_ISA / ds4-bench --isa run a chosen build this machine can run (the AVX2
  build on an AVX-512 machine, to measure an AVX2-only one); an unknown build is one clear error.
* The extension loads libgomp with OMP_WAIT_POLICY=PASSIVE unless the user set the variable (a
  spinning waiter made decode 4-6x slower on a busy 2-core machine: docs/performance.md), and the
  process's environment is left as it was.
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from engine.backends.cpu import kernels as K
from engine.gguf import quants as Q
from engine.model import ds4_matmul as D

from test_kernels import isa_guard, needs_ext, weights  # noqa: F401 (fixture)

_PROBE = ("import os; from engine.backends.cpu import kernels as K; "
          "print(K.isa(), os.environ.get('OMP_WAIT_POLICY'))")


def _probe(**env) -> subprocess.CompletedProcess:
    e = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "DS4_CPU_ISA", "GOMP_SPINCOUNT")}
    e.update(env, OMP_DISPLAY_ENV="VERBOSE")
    return subprocess.run([sys.executable, "-c", _PROBE], env=e, capture_output=True, text=True, timeout=60)


@needs_ext
def test_set_isa_takes_a_build_this_machine_runs(isa_guard):
    for isa in K._K.isas():
        K.set_isa(isa)
        assert K.isa() == isa
    with pytest.raises(ValueError, match="'avx3' is not available here"):
        K.set_isa("avx3")


@needs_ext
def test_ds4_cpu_isa_and_the_passive_wait_at_import():
    r = _probe(DS4_CPU_ISA="generic")
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["generic", "None"]          # the build chosen; the env left as it was
    assert "GOMP_SPINCOUNT = '0'" in r.stderr                # libgomp loaded passive: no spinning
    r = _probe(OMP_WAIT_POLICY="ACTIVE")
    assert r.stdout.split()[1] == "ACTIVE" and "OMP_WAIT_POLICY = 'ACTIVE'" in r.stderr


def test_ds4_bench_isa_is_one_line_error(capsys):
    from engine.bench import main
    assert main(["-m", "/nonexistent.gguf", "--isa", "avx3"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "kernel build 'avx3' is not available here" in err[0]


def test_matmul_q8_without_the_extension_is_ds4_matmul(monkeypatch):
    """The fallback computes the same function as the kernels: ds4's block order, bit for bit."""
    rng = __import__("numpy").random.default_rng(7)
    x = rng.standard_normal((2, 512)).astype("float32")
    monkeypatch.setattr(K, "_K", None)
    for t in (Q.Q8_0, Q.IQ2_XXS, Q.Q2_K):
        w = weights(t, rng, 9, 512)
        want = D.q8_0_matmul(w, D.q8_0_act(x)) if t == Q.Q8_0 else D.q8_k_matmul(t, w, D.q8_k_act(x))
        assert not K.has_q8(t)
        assert K.matmul_q8(t, w, x).tobytes() == want.tobytes()


def test_f16_seq_is_the_references_index_order(monkeypatch):
    """ds4 numerics' F16 matvec in C (kernels.matmul_f16_seq, CpuOps.linear's F16 path): the
    reference's float32 sums in index order, bit for bit, row counts around its 8-row blocks,
    infinities, signed zeros and subnormal halves included; and without the extension the same."""
    import numpy as np
    from engine.model import ds4_float as F
    rng = np.random.default_rng(36)
    cases = []
    for rows, n, T in ((37, 1024, 1), (8, 4096, 3), (5, 100, 2)):
        w = (rng.standard_normal((rows, n)) * 0.1).astype(np.float16)
        w.ravel()[:4] = [np.inf, -0.0, 6e-8, -6e-5]
        x = rng.standard_normal((T, n)).astype(np.float32)
        cases.append((w, x, F.f16_matvec(w, x)))
    for w, x, want in cases:
        assert K.matmul_f16_seq(w.view(np.uint8), x).tobytes() == want.tobytes()
        rev = x[:, ::-1].copy()                                  # another order differs: the test can fail
        assert not np.array_equal(K.matmul_f16_seq(w[:, ::-1].copy(), rev), want) or w.shape[1] < 200
    monkeypatch.setattr(K, "_K", None)
    w, x, want = cases[0]
    assert K.matmul_f16_seq(w, x).tobytes() == want.tobytes()
