"""torch's built-in int4 product (tinygemm, quant/kernels/int4_builtin.py) on CUDA, where its packing is
the device's own: our nibble order (the even column in the high nibble) gives the float64 reference
within a bf16 product's error, and the other order visibly does not; and a GGUF's Q4_1 weights kept
quantized on CUDA (bound to their kernels at load) give the dense load's logits.
"""
from __future__ import annotations

import pytest
import torch

from verispec.quant.kernels import int4_builtin, matmul as qm
from verispec.quant import mlx_affine
from verispec.quant.packing import unpack_rows

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

DEVICE = "cuda"
GROUP = 64


@pytest.mark.parametrize("n,k", [(4096, 4096), (6144, 4096), (4096, 12288)])  # Qwen3-8B's o, qkv, down
def test_packing_matches_the_reference_and_the_swapped_order_does_not(n, k):
    gen = torch.Generator().manual_seed(n + k)
    weight = (torch.randn(n, k, generator=gen) * 0.02).to(DEVICE, torch.bfloat16)
    packed, scales, biases = mlx_affine.quantize(weight, mlx_affine.AffineSpec(4, GROUP))
    q = unpack_rows(packed, 4, k)
    scale_zero = int4_builtin.scales_and_zeros(scales, biases, zero_point=False)
    ours = int4_builtin.pack(q)
    swapped = torch._convert_weight_to_int4pack((q[:, 1::2] << 4) | q[:, ::2], int4_builtin.inner_k_tiles(k))
    dense = qm.dequantize_reference(packed, scales, biases, 4, GROUP, False).to(torch.bfloat16)
    for m in (1, 4, 16):
        x = torch.randn(m, k, generator=gen).to(DEVICE, torch.bfloat16)
        ref = qm.dequant_matmul_reference(x.double(), packed, scales, biases, 4, GROUP)

        def err(y):
            return float((y.double() - ref).norm() / ref.norm())

        bf16 = err(torch.nn.functional.linear(x, dense))
        assert err(int4_builtin.matmul(x, ours, GROUP, scale_zero)) < 2 * bf16 + 1e-3, m
        assert err(int4_builtin.matmul(x, swapped, GROUP, scale_zero)) > 0.1, m


def test_gguf_q4_1_kept_quantized_gives_the_dense_logits(tmp_path, tokenizer_dir):
    """The 4-bit layers of a Q4_1 file stay quantized on CUDA, each bound to its kernel at load, and
    compute the dense load's logits up to the kernels' bf16 scales (GGUF has float16)."""
    from transformers import AutoTokenizer

    from tests.gguf.files import write_gguf
    from verispec.loading.model_loader import load_model, prepare_for_device
    from verispec.quant.layers.linear import QuantizedLinear

    case = write_gguf(tmp_path / "llama", "llama", "Q4_1", AutoTokenizer.from_pretrained(str(tokenizer_dir)), seed=3)
    prompt = [5, 9, 200, 31, 77, 13, 8, 150]
    logits, quantized = {}, {}
    for keep in (True, False):
        model = load_model(case.path, torch.bfloat16, torch.device(DEVICE), keep_gguf_4bit=keep)
        prepare_for_device(model)
        quantized[keep] = sum(isinstance(m, QuantizedLinear) for m in model.modules())
        with torch.no_grad():
            ids = torch.tensor([prompt], device=DEVICE)
            positions = torch.arange(len(prompt), device=DEVICE)[None]
            out = model(ids, positions, model.make_cache(len(prompt)))
            logits[keep] = model.logits(out.hidden)[0].float()
    assert quantized[True] > 0 and quantized[False] == 0, quantized
    rel = float((logits[True] - logits[False]).norm() / logits[False].norm())
    assert rel < 5e-2, rel
