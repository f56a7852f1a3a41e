"""What would only break on a GPU, checked on CPU: norm's numerics in bf16, compiled training that
stays compiled while train.py evaluates, the eval bundle on several nodes, the torch version."""
import pytest
import torch
import torch.nn.functional as F

from model import norm


# ----------------------------------------------------------------------------- norm in bf16

def fp32_rms_norm(x):
    """RMSNorm written out as F.rms_norm computes it: in fp32, with fp32's eps, rounded to x's dtype."""
    y = x.float()
    return (y * torch.rsqrt(y.square().mean(-1, keepdim=True) + torch.finfo(torch.float32).eps)).to(x.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scale", [1.0, 3e-4])  # 3e-4: the mean square (1e-7) is the size of the eps
def test_norm_is_the_authors_rms_norm(dtype, scale):
    g = torch.Generator().manual_seed(0)
    for shape in [(4, 16, 64), (2, 16, 4, 32)]:  # the stream (B, T, d) and QK-norm's heads (B, T, H, D)
        x = (torch.randn(shape, generator=g) * scale).to(dtype)
        out = norm(x)
        assert out.dtype == dtype
        torch.testing.assert_close(out, F.rms_norm(x, (x.size(-1),)), atol=0, rtol=0)
        torch.testing.assert_close(out, fp32_rms_norm(x), atol=0, rtol=0)


def test_norm_of_a_bf16_embedding_is_not_shrunk_by_bf16_eps():
    # x0 = norm(e) with e ~ N(0, 1) in bf16: adding bf16's eps (0.0078) would scale it by 0.996
    e = torch.randn(64, 768, generator=torch.Generator().manual_seed(0)).bfloat16()
    rms = norm(e).float().square().mean(-1).sqrt()
    torch.testing.assert_close(rms, torch.ones(64), atol=2e-3, rtol=0)  # bf16 rounding only
    with torch.autocast("cpu", dtype=torch.bfloat16):  # CPU autocast keeps it bf16 (CUDA's: fp32)
        assert norm(e).dtype == torch.bfloat16
