"""The CUDA kernels compile with NVRTC for sm_80, sm_89, sm_90 and sm_120 and assemble with
`ptxas -v`, with no GPU and no driver (scripts/cuda_compile.py; the wheels of the `cuda-build`
extra); the decode matvecs and the attention do not spill; docs/cuda.md's register table is the
one this compile gives; and a syntax error in a kernel fails the compile."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
import cuda_compile  # noqa: E402

try:
    cuda_compile.tools()
    MISSING = None
except cuda_compile.CompileError as e:
    MISSING = str(e)

pytestmark = pytest.mark.skipif(MISSING is not None, reason=f"NVRTC/ptxas wheels missing: {MISSING}")


def test_every_kernel_compiles_for_four_architectures_without_spills_and_the_table_is_current():
    table = cuda_compile.compile_all()
    assert set(table) == {"sm_80", "sm_89", "sm_90", "sm_120"}
    names = set(table["sm_80"])
    assert all(set(t) == names for t in table.values())
    for fmt in ("q8_0", "f16", "iq2_xxs", "q2_k", "q4_k", "mxfp4"):
        assert {f"matvec_experts_{fmt}", f"gemm_experts_{fmt}", f"dequant_rows_{fmt}"} <= names
    assert {"attn_segment", "attn_finish", "rmsnorm", "rmsnorm_ds4", "rope", "hc_split", "topk", "indexer_scores",
            "ds4_matvec_q8_0", "ds4_matvec_iq2_xxs", "ds4_matvec_q2_k",
            "ds4_gemm_q8_0", "ds4_gemm_iq2_xxs", "ds4_gemm_q2_k", "q8_0_quantize", "q8_k_quantize"} <= names
    assert cuda_compile.spills(table) == []
    doc = cuda_compile.DOC.read_text()
    assert cuda_compile.current_table(doc) == cuda_compile.render(table), \
        "docs/cuda.md's ptxas table is stale: run python scripts/cuda_compile.py"


def test_a_syntax_error_fails_the_compile():
    src = (cuda_compile.KERNELS / "norm_rope.cu").read_text()
    broken = src.replace(") {\n", ") {\n  int missing_semicolon = 1\n", 1)    # in the first function body
    assert broken != src
    with pytest.raises(cuda_compile.CompileError, match='expected a ";"'):
        cuda_compile.compile_all({"norm_rope.cu": broken}, archs=("sm_80",))


def test_a_spill_in_a_decode_matvec_is_refused():
    table = {"sm_80": {"matvec_experts_q8_0": {"regs": 255, "smem": 0, "stack": 8, "spill": 8, "file": "m.cu"},
                       "hc_split": {"regs": 40, "smem": 0, "stack": 256, "spill": 4, "file": "h.cu"}}}
    assert cuda_compile.spills(table) == ["matvec_experts_q8_0 spills 8 bytes on sm_80"]


def test_the_tensor_core_kernels_compile_their_mma_and_not_the_fallback():
    """ds4_mma.cu's PTX holds the int8 mma on sm_80..sm_120; an arch guard that selected the
    sm < 80 trap instead would compile silently, and is refused."""
    src = (cuda_compile.KERNELS / "ds4_mma.cu").read_text()
    assert "__CUDA_ARCH__ >= 800" in src
    cuda_compile.compile_all({"ds4_mma.cu": src}, archs=("sm_80", "sm_120"))
    with pytest.raises(cuda_compile.CompileError, match="no mma.sync"):
        cuda_compile.compile_all({"ds4_mma.cu": src.replace("__CUDA_ARCH__ >= 800", "__CUDA_ARCH__ >= 1300")},
                                 archs=("sm_90",))
