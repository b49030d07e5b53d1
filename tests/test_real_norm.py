"""real/norm.py: one kernel per RMSNorm on a GPU, numerically the eager fp32 formula
(``rms_norm_reference``). On the CPU: torch's ``F.rms_norm`` (the op that runs its fused CUDA
kernel there) against the formula, the fused add's fallback, and the Triton kernel under
Triton's CPU interpreter in a child process (tests/triton_interp.py; fp32 and fp16: bf16 does
not survive the interpreter). The CUDA kernels themselves: tests/test_real_gpu.py."""

import sys

import pytest

from tests.triton_interp import interpreted, report

torch = pytest.importorskip("torch")
import torch.nn.functional as F  # noqa: E402

from overlap_lab.real import norm  # noqa: E402


def _inputs(shape, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(*shape, generator=g) * 3).to(dtype)
    r = torch.randn(*shape, generator=g).to(dtype)
    w = (1 + 0.1 * torch.randn(shape[-1], generator=g)).to(dtype)
    return x, r, w


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_torchs_rms_norm_is_the_formula(dtype):
    """``F.rms_norm`` (what :func:`norm.rms_norm` calls on CUDA) computes the formula: fp32
    inside, the weight applied in fp32, one rounding to the input's dtype."""
    x, _, w = _inputs((7, 96), dtype)
    ref = norm.rms_norm_reference(x, w, 1e-6)
    got = F.rms_norm(x, (96,), w, 1e-6)
    assert got.dtype == dtype
    torch.testing.assert_close(got, ref, rtol=0, atol=0)
    torch.testing.assert_close(norm.rms_norm(x, w, 1e-6), ref, rtol=0, atol=0)  # CPU: formula


def test_fused_add_rms_norm_without_triton_is_add_then_norm():
    x, r, w = _inputs((5, 3, 64), torch.float32)
    y, s = norm.fused_add_rms_norm(x, r, w, 1e-5)
    torch.testing.assert_close(s, x + r, rtol=0, atol=0)
    torch.testing.assert_close(y, norm.rms_norm_reference(x + r, w, 1e-5), rtol=0, atol=0)


@pytest.fixture(scope="module")
def interpreter_results():
    return interpreted(__file__)


@pytest.mark.parametrize("check", ["fp32", "fp16", "odd_k_3d_strided"])
def test_the_triton_kernel_under_the_interpreter(interpreter_results, check):
    assert interpreter_results[check] == "ok", interpreter_results[check]


def _interp_matches(dtype, shape, strided=False):
    x, r, w = _inputs(shape, dtype, seed=1)
    if strided:  # rows of a wider tensor: a row stride other than K
        x = torch.cat([x, x], dim=-1)[..., : shape[-1]]
    assert norm.fused_add_rms_norm.__module__ == "overlap_lab.real.norm"
    y, s = norm._add_rms_norm_fused(x, r, w, 1e-6)
    want_s = x + r
    torch.testing.assert_close(s, want_s, rtol=0, atol=0)  # the sum rounded as torch rounds it
    tol = 1e-6 if dtype == torch.float32 else 1e-3
    torch.testing.assert_close(y, norm.rms_norm_reference(want_s, w, 1e-6), rtol=tol, atol=tol)
    y2, s2 = norm.fused_add_rms_norm(x, r, w, 1e-6)  # the public call takes the kernel here
    assert torch.equal(y2, y) and torch.equal(s2, s)


def test_the_norm_kernel_compiles_for_hopper_without_a_gpu():
    """The kernel compiles to an sm_90 cubin in bf16 (what the interpreter cannot check)."""
    triton = pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    import overlap_lab.real._triton_norm as TN

    sig = {k: "*bf16" for k in ("x", "r", "s", "y", "w")}
    sig |= {k: "i32" for k in ("K", "sx", "sr", "ss", "sy")} | {"eps": "fp32"}
    consts = {"BLOCK": 8192, "RESIDUAL": True}
    try:
        k = triton.compile(
            ASTSource(fn=TN.add_rms_norm, signature={**sig, **dict.fromkeys(consts, "constexpr")},
                      constexprs=consts),
            target=GPUTarget("cuda", 90, 32),
            options={"num_warps": 16},
        )  # fmt: skip
    except (FileNotFoundError, ImportError) as e:  # no bundled ptxas on this platform
        pytest.skip(f"cannot compile for sm_90 here: {e}")
    assert k.asm.get("cubin")


if __name__ == "__main__":  # the interpreter child (see interpreter_results)
    from overlap_lab.real.deps import interpreting

    assert interpreting(), "run with TRITON_INTERPRET=1"
    checks = {
        "fp32": lambda: _interp_matches(torch.float32, (6, 128)),
        "fp16": lambda: _interp_matches(torch.float16, (4, 256)),
        "odd_k_3d_strided": lambda: _interp_matches(torch.float32, (2, 3, 72), strided=True),
    }
    report(checks)
    sys.exit(0)
