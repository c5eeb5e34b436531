"""The SoC table: one place that maps a phone's chip to what quantization, compilation and deploy need.

Shared by the quantize stage (HTP quantsim config), the compile stage (htp_arch / soc_model) and
the device panel (`ro.soc.model` of a connected phone).
"""

from __future__ import annotations

from pydantic import BaseModel

from .errors import UserError


class Soc(BaseModel):
    soc: str  # e.g. SM8750 (what `getprop ro.soc.model` says)
    product: str
    soc_model: int | None  # QNN's soc_model id
    dsp_arch: str  # v73, v75, v79, v81 ...
    memory_gb_s: float  # peak LPDDR bandwidth (public spec sheets): the decode roofline

    @property
    def arch_number(self) -> int:
        return int(self.dsp_arch.lstrip("v"))


KNOWN_SOCS: dict[str, Soc] = {s.soc: s for s in (
    Soc(soc="SM8550", product="Snapdragon 8 Gen 2", soc_model=43, dsp_arch="v73", memory_gb_s=68.3),
    Soc(soc="SM8650", product="Snapdragon 8 Gen 3", soc_model=57, dsp_arch="v75", memory_gb_s=76.8),
    Soc(soc="SM8750", product="Snapdragon 8 Elite", soc_model=69, dsp_arch="v79", memory_gb_s=85.3),
    Soc(soc="SM8850", product="Snapdragon 8 Elite Gen 5", soc_model=88, dsp_arch="v81", memory_gb_s=85.3),
    Soc(soc="SC8380XP", product="Snapdragon X Elite / X Plus", soc_model=60, dsp_arch="v73", memory_gb_s=135.0),
)}
DEFAULT_SOC = "SM8750"
# An app may use about half of a phone's RAM: Android keeps the rest for itself and the apps in the background. The
# phone-fit estimate (core/model_fit.py), deploy's check of a phone (core/device) and the window's fit column read it.
APP_RAM_SHARE = 0.5
RUNTIME_RAM_BYTES = 256 * 1024**2  # Genie and QNN's own memory beside the model's


def find_soc(name: str) -> Soc:
    """The SoC by its part number (any case), or a UserError listing the known ones."""
    key = name.strip().upper()
    if key not in KNOWN_SOCS:
        raise UserError(f"Unknown target SoC {name!r}.",
                        "Use one of: " + ", ".join(f"{s.soc} ({s.product})" for s in KNOWN_SOCS.values()) + ".")
    return KNOWN_SOCS[key]


def fits_phone_ram(need_bytes: float, phone_ram_bytes: float) -> bool:
    """Whether a model that needs `need_bytes` of RAM loads on a phone with `phone_ram_bytes`."""
    return need_bytes <= APP_RAM_SHARE * phone_ram_bytes


def decode_tok_s_bound(target: Soc, bytes_per_token: float) -> float:
    """Upper bound on decode speed: each generated token reads `bytes_per_token` (all weights and the KV cache)
    once from the phone's memory at its peak bandwidth."""
    return round(target.memory_gb_s * 1e9 / bytes_per_token, 1)
