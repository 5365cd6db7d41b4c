"""Which group offsets torch._grouped_mm accepts on this GPU (bf16, 2-D x 3-D with offs): the fact
behind docs/moe.md's "Which alignment" advice. Prints one line per alignment."""
import torch

a = torch.randn(1000, 256, device="cuda", dtype=torch.bfloat16)
b = torch.randn(4, 256, 128, device="cuda", dtype=torch.bfloat16)
for name, ends in (("unaligned", [5, 17, 600, 1000]), ("16", [16, 48, 608, 1000]), ("128", [128, 256, 640, 1000])):
    offs = torch.tensor(ends, dtype=torch.int32, device="cuda")
    try:
        out = torch._grouped_mm(a, b, offs=offs)
        starts = [0] + ends[:-1]
        err = max(float((out[s:e].float() - a[s:e].float() @ b[g].float()).abs().max()) for g, (s, e) in
                  enumerate(zip(starts, ends)))
        print(f"grouped_mm offs {name}: ok, max |err| vs fp32 matmul {err:.3g}")
    except Exception as exc:  # report what the op says
        print(f"grouped_mm offs {name}: refused: {str(exc)[:200]}")
