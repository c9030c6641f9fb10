"""The float16 pass (``triton_gemm.fp16_row_parts``) on the GPU against the same arithmetic in torch.

    python3 benchmarks/gpu/fp16_parts_edges.py

The CPU check (``fp16_operands`` in tests/interpreted/check_triton.py) runs it through Triton's
interpreter, whose arithmetic is numpy's; this runs the compiled kernel on rows the interpreter
cannot speak for: denormal values (a GPU may flush them), NaN next to finite values (max may skip
NaN), inf, zero, near float32's max, randn spread over 1e±20, and K = 5003 (several blocks and
a tail). Prints, per row, whether hi, lo and 1/s equal torch's bit for bit.
"""

import torch

from autofuse.kernels.triton import variant as tv


def on_the_host(t):
    biased = (t.abs().amax(dim=1).view(torch.int32) >> 23) & 0xFF
    e = (14 - (biased - 127)).clamp(-126, 126)
    scaled = t * torch.pow(2.0, e.float())[:, None]
    hi = scaled.half()
    return hi, (scaled - hi.float()).half(), torch.pow(2.0, -e.float())


g = torch.Generator().manual_seed(5)
k = 5003
rows = {"spread 1e±20": torch.randn(k, generator=g) * torch.logspace(-20, 20, k)[torch.randperm(k, generator=g)],
        "randn": torch.randn(k, generator=g), "zeros": torch.zeros(k), "denormal 1e-40": torch.full((k,), 1e-40),
        "denormal and normal": torch.cat([torch.full((k - 1,), 1e-40), torch.ones(1)]),
        "near max": torch.randn(k, generator=g).clamp(-3, 3) * 1e38 / 3}
nan_row = torch.randn(k, generator=g)
nan_row[11] = float("nan")
inf_row = torch.randn(k, generator=g)
inf_row[7] = float("inf")
rows.update({"nan": nan_row, "inf": inf_row})
x = torch.stack(list(rows.values()))
got = tv.fp16_parts(x.cuda(), split=True)
want = on_the_host(x)
print(torch.cuda.get_device_name())
for i, name in enumerate(rows):
    same = [torch.equal(g_[i].cpu().view(torch.int16 if g_.dtype == torch.float16 else torch.int32)
                        if g_.dim() > 1 else g_[i].cpu(), w_[i].view(torch.int16 if w_.dtype == torch.float16
                                                                      else torch.int32) if w_.dim() > 1 else w_[i])
            for g_, w_ in zip(got, want)]
    print(f"{name:22s} hi {same[0]} lo {same[1]} 1/s {same[2]} (GPU 1/s {got[2][i].item():.3g}, "
          f"torch {want[2][i].item():.3g}; hi nonzero {int((got[0][i] != 0).sum())} / {int((want[0][i] != 0).sum())})")
