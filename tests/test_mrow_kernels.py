"""The multi-token kernels of the cpu backend's T-row step (issue 37: MTP verify, batched decode):
mrow_q8.c (Q8_0 integer rows, 2-8 tokens a pass on the AVX-512 VNNI builds) and mrow_f16.c (ds4's
F16 matvec, 8 rows a vector). A row's result must not depend on how many tokens share the pass:
bit for bit the reference (ds4's block order / index order) at every token count, on every build
this machine runs, with shapes around the kernels' blocks (row counts off 8, tail blocks)."""
from __future__ import annotations

import numpy as np
import pytest

from engine.backends.cpu import kernels as K
from engine.gguf import quants as Q
from engine.model import ds4_float as F
from engine.model import ds4_matmul as D

pytestmark = pytest.mark.skipif(not K.available(), reason="the C extension is not built (no compiler at install)")


@pytest.fixture
def each_build():
    prev = K.isa()
    builds = [b for b in K._K.isas()]
    yield builds
    K.set_isa(prev)


def test_q8_0_rows_are_the_reference_at_every_token_count(each_build):
    rng = np.random.default_rng(37)
    cases = []
    for rows, n in ((19, 1024), (5, 1024 + 96), (3, 32)):     # n % 256: tail blocks; 32: no 8-block group
        w = np.ascontiguousarray(Q.random_blocks(Q.Q8_0, rng, rows * n // 32, 0.05).reshape(rows, -1))
        x = rng.standard_normal((12, n)).astype(np.float32)
        x[0, :4] = [0.0, 1e-38, -3.0, 100.0]
        cases.append((w, x, D.q8_0_matmul(w, D.q8_0_act(x))))
    for build in each_build:
        K.set_isa(build)
        for w, x, want in cases:
            for T in (1, 2, 3, 5, 8, 9, 12):
                assert K.matmul_q8(Q.Q8_0, w, x[:T]).tobytes() == want[:T].tobytes(), (build, w.shape, T)


def test_f16_rows_are_the_reference_at_every_token_count(each_build):
    rng = np.random.default_rng(38)
    cases = []
    for rows, n in ((24, 1024), (13, 1037), (4, 16)):
        w = (rng.standard_normal((rows, n)) * 0.1).astype(np.float16)
        w.ravel()[:4] = [np.inf, -0.0, 6e-8, -6e-5]
        x = rng.standard_normal((9, n)).astype(np.float32)
        cases.append((w, x, F.f16_matvec(w, x)))
    for build in each_build:
        K.set_isa(build)
        for w, x, want in cases:
            for T in (1, 2, 3, 4, 5, 9):
                assert K.matmul_f16_seq(w, x[:T]).tobytes() == want[:T].tobytes(), (build, w.shape, T)
