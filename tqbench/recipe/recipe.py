"""A recipe: how each tier of a model is stored after conversion. A name and a set of flags are two spellings of it.

Tiers and formats:
- base tier: every quantized Linear that is not a routed expert (attention, shared experts, LatentMoE projections,
  dense MLPs, lm_head), in `format` at `bits` (attention at `attn_bits` when given), group `group_size`;
- expert tier: routed experts, in `expert_format` (default: the base format) at `mlp_bits` (default `bits`),
  ternary with `ternary_experts`, their down projection at `expert_down_bits` when given, group `mlp_group_size`
  (default `group_size`).
Formats: `turboquant` (Hadamard rotation + Lloyd-Max codebook, 2/3/4-bit or ternary experts), `affine` (MLX affine,
2/3/4/5/6/8-bit), `mxfp4` (experts only: source mxfp4 experts copied byte for byte), `source` (kept as stored).

Name parts, joined by `-` in any order (case-insensitive); `Recipe.name` writes them in this order:
    tqN / affineN / src   base tier: TurboQuant or MLX affine N-bit, or source precision (`tq3`: everything 3-bit)
    tqNa / affineNa / srca  the same, spelled with `a` when the expert tier differs: `tq3a-tqTe` = 3-bit attention
                            and base, ternary experts. Given with a base part (`tq4-tq3a`) it sets attention bits only.
    tqNe / affineNe       routed experts N-bit (TurboQuant or affine)
    tqTe                  ternary routed experts (TurboQuant, 20 trits per uint32)
    mxfp4e / srce         routed experts copied from mxfp4 sources / kept at source precision
    downN                 routed experts' down projection N-bit (in the expert format; not ternary)
    gN                    group size (32, 64 or 128; default 64)
    mlpgN                 routed experts' group size
    norot                 no Hadamard rotation (TurboQuant tiers only)
    rms                   TurboQuant group scales by the RMS alone (TurboQuant-MLX's rule; default: searched per group,
                          tqbench.quant.turboquant.SCALE_RULES)
    cal                   calibrated rounding: TurboQuant codes fitted to the source model's own activations
                          (tqbench.quant.calibrate); same format and bytes, other codes
    seedN                 rotation seed (default 42; per layer: seed + crc32(path))
Without a base part the base is `tq3`. Examples: `tq3a-tqTe-down4-g64` = bits 3, group 64, ternary experts,
expert down bits 4 (the published Kimi K3 build); `tqTe-mlpg128-g64` reads as `tq3a-tqTe-g64-mlpg128`.

Recipes are normalised, so equal meaning means equal value: `parse(r.name) == r` for every recipe and
`parse(n).name == n` for every name `Recipe.name` writes. Whether a group size divides a layer is not checked here:
a recipe does not know shapes. Per the reference, a Linear with a dimension < 32 or `in % g != 0` is kept at source
precision and shown in the plan (tqbench.recipe.rules), never an error.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass
from enum import StrEnum
from typing import Any

from tqbench.errors import TqbenchError


class RecipeError(TqbenchError):
    """A recipe name or flag combination that cannot be built."""


class Format(StrEnum):
    TURBOQUANT = "turboquant"
    AFFINE = "affine"
    MXFP4 = "mxfp4"  # routed experts only: mxfp4 source bytes copied as they are
    SOURCE = "source"


TQ_BITS = (2, 3, 4)
AFFINE_BITS = (2, 3, 4, 5, 6, 8)  # what mx.quantize accepts
GROUP_SIZES = (32, 64, 128)
DEFAULT_BITS = 3
DEFAULT_GROUP = 64
DEFAULT_SEED = 42
SCALE_RULES = ("search", "rms")  # tqbench.quant.turboquant.SCALE_RULES (importing it loads MLX)
DEFAULT_SCALES = SCALE_RULES[0]

_PREFIX = {Format.TURBOQUANT: "tq", Format.AFFINE: "affine", Format.SOURCE: "src"}
_QUANTIZED = (Format.TURBOQUANT, Format.AFFINE)


@dataclass(frozen=True, kw_only=True)
class Recipe:
    bits: int = DEFAULT_BITS
    group_size: int = DEFAULT_GROUP
    attn_bits: int | None = None  # None: bits
    mlp_bits: int | None = None  # routed experts; None: bits
    ternary_experts: bool = False
    expert_down_bits: int | None = None  # None: like the other expert projections
    mlp_group_size: int | None = None  # routed experts; None: group_size
    rotation: bool = True
    seed: int = DEFAULT_SEED
    format: Format = Format.TURBOQUANT  # base tier
    expert_format: Format | None = None  # None: format
    scales: str = DEFAULT_SCALES  # how TurboQuant tiers choose group scales (SCALE_RULES)
    calibrate: bool = False  # TurboQuant codes by calibrated rounding (tqbench.quant.calibrate)

    def __post_init__(self) -> None:
        _validate(self)
        for field, value in _normalised(self).items():
            object.__setattr__(self, field, value)

    # Effective values, after defaults.
    @property
    def attention_bits(self) -> int:
        return self.bits if self.attn_bits is None else self.attn_bits

    @property
    def experts_format(self) -> Format:
        return self.format if self.expert_format is None else self.expert_format

    @property
    def expert_bits(self) -> int:
        return self.bits if self.mlp_bits is None else self.mlp_bits

    @property
    def expert_group_size(self) -> int:
        return self.group_size if self.mlp_group_size is None else self.mlp_group_size

    @property
    def uses_turboquant(self) -> bool:
        return Format.TURBOQUANT in (self.format, self.experts_format)

    @property
    def quantizes(self) -> bool:
        return self.format in _QUANTIZED or self.experts_format in _QUANTIZED

    @property
    def name(self) -> str:
        return _name(self)

    @classmethod
    def parse(cls, name: str) -> Recipe:
        return _parse(name)

    @classmethod
    def from_flags(
        cls,
        bits: int | None = None,
        group_size: int | None = None,
        attn_bits: int | None = None,
        mlp_bits: int | None = None,
        ternary_experts: bool = False,
        expert_down_bits: int | None = None,
        mlp_group_size: int | None = None,
        rotation: bool = True,
        seed: int | None = None,
        format: str | Format | None = Format.TURBOQUANT,
        expert_format: str | Format | None = None,
        scales: str | None = None,
        calibrate: bool = False,
    ) -> Recipe:
        """The CLI flags (`--bits 3 -g 64 --ternary-experts --expert-down-bits 4`) as a recipe."""
        return cls(
            bits=DEFAULT_BITS if bits is None else bits,
            group_size=DEFAULT_GROUP if group_size is None else group_size,
            attn_bits=attn_bits,
            mlp_bits=mlp_bits,
            ternary_experts=ternary_experts,
            expert_down_bits=expert_down_bits,
            mlp_group_size=mlp_group_size,
            rotation=rotation,
            seed=DEFAULT_SEED if seed is None else seed,
            format=Format.TURBOQUANT if format is None else _format(format, "format"),
            expert_format=None if expert_format is None else _format(expert_format, "expert format"),
            scales=DEFAULT_SCALES if scales is None else str(scales).lower(),
            calibrate=calibrate,
        )

    def to_dict(self) -> dict[str, Any]:
        """Effective values under their flag names, plus the name."""
        base_q, experts_q = self.format in _QUANTIZED, self.experts_format in _QUANTIZED
        d = asdict(self)
        d.update(name=self.name, bits=self.bits if base_q else None, attn_bits=self.attention_bits if base_q else None,
                 mlp_bits=self.expert_bits if experts_q and not self.ternary_experts else None,
                 mlp_group_size=self.expert_group_size if experts_q else None,
                 group_size=self.group_size if self.quantizes else None,
                 format=self.format.value, expert_format=self.experts_format.value,
                 scales=self.scales if self.uses_turboquant else None)
        if not self.calibrate:  # only a calibrated recipe says so: every other one's record (config.json, the plan
            del d["calibrate"]  # fingerprint, what was learned about it) stays as it was before `cal` existed
        return {"name": d.pop("name"), **d}


def _format(value: str | Format, what: str) -> Format:
    try:
        return Format(str(value).lower())
    except ValueError:
        raise RecipeError(f"unknown {what} {value!r} (known: {', '.join(f.value for f in Format)})") from None


def _check_bits(bits: int, fmt: Format, what: str) -> None:
    allowed = TQ_BITS if fmt is Format.TURBOQUANT else AFFINE_BITS
    if bits not in allowed:
        raise RecipeError(f"{what} {bits} is out of range for {fmt.value} (allowed: {', '.join(map(str, allowed))})")


def _validate(r: Recipe) -> None:
    for field in ("bits", "group_size", "seed"):
        if not isinstance(getattr(r, field), int) or isinstance(getattr(r, field), bool):
            raise RecipeError(f"{field} must be an integer, got {getattr(r, field)!r}")
    if not isinstance(r.format, Format) or not (r.expert_format is None or isinstance(r.expert_format, Format)):
        raise RecipeError("format and expert_format must be tqbench.recipe.Format values (use Recipe.from_flags)")
    base, experts = r.format, r.experts_format
    if base is Format.MXFP4:
        raise RecipeError("mxfp4 passthrough applies to routed experts only (spell it mxfp4e / --expert-format mxfp4)")
    if base in _QUANTIZED:
        _check_bits(r.bits, base, "bits")
        if r.attn_bits is not None:
            _check_bits(r.attn_bits, base, "attention bits")
    elif r.attn_bits is not None:
        raise RecipeError(f"attention bits {r.attn_bits} given, but the base tier is kept at source precision")
    if r.ternary_experts:
        if experts is not Format.TURBOQUANT:
            raise RecipeError(f"ternary experts are a TurboQuant codebook; the expert format is {experts.value}")
        if r.mlp_bits is not None and r.mlp_bits != r.bits:
            raise RecipeError(f"ternary experts and {r.mlp_bits}-bit experts (mlp bits) contradict each other")
    if experts in _QUANTIZED:
        if not r.ternary_experts:
            _check_bits(r.expert_bits, experts, "expert bits")
        if r.expert_down_bits is not None:
            _check_bits(r.expert_down_bits, experts, "expert down bits")
    else:
        for value, what in ((r.mlp_bits, "expert bits"), (r.expert_down_bits, "expert down bits"),
                            (r.mlp_group_size, "expert group size")):
            if value is not None:
                raise RecipeError(f"{what} {value} given, but routed experts are {_kept(experts)}")
    if r.quantizes:
        _check_group(r.group_size, "group size")
    elif r.group_size != DEFAULT_GROUP:
        raise RecipeError(f"group size {r.group_size} given, but nothing is quantized")
    uses_bits = base in _QUANTIZED or (experts in _QUANTIZED and not r.ternary_experts and r.mlp_bits is None)
    if not uses_bits and r.bits != DEFAULT_BITS:
        raise RecipeError(f"bits {r.bits} given, but no tier uses them")
    if r.mlp_group_size is not None:
        _check_group(r.mlp_group_size, "expert group size")
    if not r.uses_turboquant:
        if not r.rotation:
            raise RecipeError("no rotation (norot) given, but no tier uses TurboQuant")
        if r.seed != DEFAULT_SEED:
            raise RecipeError(f"rotation seed {r.seed} given, but no tier uses TurboQuant")
        if r.scales != DEFAULT_SCALES:
            raise RecipeError(f"scale rule {r.scales} given, but no tier uses TurboQuant")
        if r.calibrate:
            raise RecipeError("calibrated rounding (cal) given, but no tier uses TurboQuant")
    if r.scales not in SCALE_RULES:
        raise RecipeError(f"scale rule {r.scales!r} is not one of {', '.join(SCALE_RULES)}")
    if not 0 <= r.seed < 2**31:
        raise RecipeError(f"seed must be in [0, 2^31), got {r.seed}")


def _check_group(g: int, what: str) -> None:
    if g not in GROUP_SIZES:
        raise RecipeError(f"{what} {g} is not one of {', '.join(map(str, GROUP_SIZES))}")


def _kept(fmt: Format) -> str:
    return "copied as mxfp4" if fmt is Format.MXFP4 else "kept at source precision"


def _normalised(r: Recipe) -> dict[str, Any]:
    """Fields rewritten so that two recipes meaning the same thing compare equal."""
    experts, expert_bits = r.experts_format, r.expert_bits
    out: dict[str, Any] = {}
    if r.format not in _QUANTIZED:  # bits only matter as the experts' default: move them there
        out["bits"] = DEFAULT_BITS
    bits = out.get("bits", r.bits)
    out["expert_format"] = None if experts is r.format else experts
    out["attn_bits"] = None if r.attn_bits == bits else r.attn_bits
    if experts not in _QUANTIZED or r.ternary_experts or expert_bits == bits:
        out["mlp_bits"] = None
    else:
        out["mlp_bits"] = expert_bits
    if r.expert_down_bits is not None and not r.ternary_experts and r.expert_down_bits == expert_bits:
        out["expert_down_bits"] = None
    if r.mlp_group_size == r.group_size:
        out["mlp_group_size"] = None
    if not r.quantizes:
        out["group_size"] = DEFAULT_GROUP
    return out


def _expert_part(r: Recipe) -> str | None:
    """The expert-tier part, or None when experts follow the base tier."""
    fmt = r.experts_format
    if r.ternary_experts:
        return "tqTe"
    if fmt is r.format and r.expert_bits == r.bits:
        return None
    if fmt is Format.MXFP4:
        return "mxfp4e"
    if fmt is Format.SOURCE:
        return "srce"
    return f"{_PREFIX[fmt]}{r.expert_bits}e"


def _name(r: Recipe) -> str:
    expert = _expert_part(r)
    prefix = _PREFIX[r.format]
    base = prefix + (str(r.bits) if r.format in _QUANTIZED else "")
    differs = expert is not None or r.expert_down_bits is not None
    parts = [base, f"{prefix}{r.attn_bits}a"] if r.attn_bits is not None else [base + ("a" if differs else "")]
    if expert:
        parts.append(expert)
    if r.expert_down_bits is not None:
        parts.append(f"down{r.expert_down_bits}")
    if r.quantizes:
        parts.append(f"g{r.group_size}")
    if r.mlp_group_size is not None:
        parts.append(f"mlpg{r.mlp_group_size}")
    if not r.rotation:
        parts.append("norot")
    if r.seed != DEFAULT_SEED:
        parts.append(f"seed{r.seed}")
    if r.scales != DEFAULT_SCALES:
        parts.append(r.scales)
    if r.calibrate:
        parts.append("cal")
    return "-".join(parts)


_PART = re.compile(
    r"(?P<fmt>tq|affine)(?P<bits>\d+)(?P<tier>[ae]?)|(?P<src>src)(?P<srctier>[ae]?)|(?P<tqte>tqte)|(?P<mxfp4e>mxfp4e)"
    r"|down(?P<down>\d+)|mlpg(?P<mlpg>\d+)|g(?P<g>\d+)|(?P<norot>norot)|seed(?P<seed>\d+)|(?P<rms>rms)|(?P<cal>cal)"
)
_KNOWN = ("tqN, tqNa, tqNe, tqTe, affineN, affineNa, affineNe, src, srca, srce, mxfp4e, downN, gN, mlpgN, norot, "
          "seedN, rms, cal")


def _parse(name: str) -> Recipe:
    text = str(name).strip()
    if not text:
        raise RecipeError("empty recipe name")
    seen: dict[str, str] = {}
    base: tuple[Format, int | None] | None = None
    attn: tuple[Format, int | None] | None = None
    kw: dict[str, Any] = {}

    def once(slot: str, part: str) -> None:
        if slot in seen:
            raise RecipeError(f"recipe {text!r}: {part!r} and {seen[slot]!r} both set the {slot}")
        seen[slot] = part

    for part in text.split("-"):
        if not part:
            raise RecipeError(f"recipe {text!r}: empty part (two dashes in a row, or a dash at an end)")
        m = _PART.fullmatch(part.lower())
        if not m:
            raise RecipeError(f"recipe {text!r}: unknown part {part!r} (known: {_KNOWN})")
        g = m.groupdict()
        if g["fmt"] or g["src"]:
            fmt = Format.SOURCE if g["src"] else (Format.TURBOQUANT if g["fmt"] == "tq" else Format.AFFINE)
            bits = None if g["src"] else int(g["bits"])
            tier = g["srctier"] if g["src"] else g["tier"]
            if tier == "e":
                once("expert tier", part)
                kw["expert_format"] = fmt
                if bits is not None:
                    kw["mlp_bits"] = bits
            elif tier == "a":
                once("attention tier", part)
                attn = (fmt, bits)
            else:
                once("base tier", part)
                base = (fmt, bits)
        elif g["tqte"]:
            once("expert tier", part)
            kw.update(expert_format=Format.TURBOQUANT, ternary_experts=True)
        elif g["mxfp4e"]:
            once("expert tier", part)
            kw["expert_format"] = Format.MXFP4
        elif g["down"]:
            once("expert down bits", part)
            kw["expert_down_bits"] = int(g["down"])
        elif g["mlpg"]:
            once("expert group size", part)
            kw["mlp_group_size"] = int(g["mlpg"])
        elif g["g"]:
            once("group size", part)
            kw["group_size"] = int(g["g"])
        elif g["norot"]:
            once("rotation", part)
            kw["rotation"] = False
        elif g["rms"]:
            once("scale rule", part)
            kw["scales"] = "rms"
        elif g["cal"]:
            once("calibration", part)
            kw["calibrate"] = True
        else:
            once("seed", part)
            kw["seed"] = int(g["seed"])

    if base and attn and base[0] is not attn[0]:
        raise RecipeError(f"recipe {text!r}: the attention part must use the base format ({base[0].value})")
    if attn and not base:
        base, attn = attn, None  # `tq3a` alone: the 3-bit base, spelled for a differing expert tier
    fmt, bits = base or (Format.TURBOQUANT, DEFAULT_BITS)
    if attn is not None:
        if fmt is Format.SOURCE:
            raise RecipeError(f"recipe {text!r}: `src` and `srca` both given")
        kw["attn_bits"] = attn[1]
    kw["format"] = fmt
    kw["bits"] = DEFAULT_BITS if bits is None else bits
    if "mlp_bits" in kw and kw.get("expert_format") is None:
        kw["expert_format"] = fmt
    try:
        return Recipe(**kw)
    except RecipeError as e:
        raise RecipeError(f"recipe {text!r}: {e.message}") from None


@dataclass(frozen=True, kw_only=True)
class RecipeFlags:
    """The recipe flags as a user gave them (`--bits 3 -g 64 --ternary-experts --expert-down-bits 4`): None or the
    default where not given. A second spelling of a recipe name; `recipe()` makes the Recipe they spell."""

    bits: int | None = None
    group_size: int | None = None
    attn_bits: int | None = None
    mlp_bits: int | None = None
    ternary_experts: bool = False
    expert_down_bits: int | None = None
    mlp_group_size: int | None = None
    rotation: bool = True
    seed: int | None = None
    format: str | None = None
    expert_format: str | None = None
    scales: str | None = None
    calibrate: bool = False

    @property
    def given(self) -> bool:
        """Any flag differs from its default."""
        return self != RecipeFlags()

    def recipe(self) -> Recipe:
        return Recipe.from_flags(**asdict(self))
