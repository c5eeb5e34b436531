"""What the quantize stage hands the compilers besides the graphs: one shared weights file and, per graph, test
vectors (the inputs of one real step with the float and quantsim outputs) that compile checks the HTP against."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch



def write_test_vectors(path: Path, feeds: dict[str, torch.Tensor], fp: dict[str, torch.Tensor],
                       quant: dict[str, torch.Tensor]) -> None:
    """Inputs + FP and quantized outputs of one step, as a plain .npz (no pickle inside)."""
    import numpy as np

    arrays = {f"in/{k}": v.detach().cpu().numpy() for k, v in feeds.items()}
    arrays |= {f"fp/{k}": v.detach().float().cpu().numpy() for k, v in fp.items()}
    arrays |= {f"quant/{k}": v.detach().float().cpu().numpy() for k, v in quant.items()}
    tmp = path.with_name(path.name + ".tmp.npz")
    np.savez_compressed(tmp, **arrays)  # type: ignore[arg-type]  # (numpy's stub reads **arrays as allow_pickle)
    os.replace(tmp, path)


def read_test_vectors(path: Path) -> dict[str, dict[str, Any]]:
    import numpy as np

    with np.load(path, allow_pickle=False) as z:
        out: dict[str, dict[str, Any]] = {"in": {}, "fp": {}, "quant": {}}
        for k in z.files:
            group, _, name = k.partition("/")
            out[group][name] = z[k]
    return out
