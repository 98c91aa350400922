"""Command-line options shared by several commands, each declared once, and the Typer app every command is registered
on, whose usage lines read as Unix ones.

Options that make one record the engine takes (the recipe flags, expert streaming, sampling, the profile) form an
`OptionGroup`: a command names the record as one parameter, `@takes(...)` gives the command every option of the group
in its place, and the command receives the record they build."""

from __future__ import annotations

import functools
import inspect
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Callable, Optional

import click
import typer
from typer.core import TyperCommand

from tqbench.chat.request import ProfileOptions, SamplingRequest, StreamRequest
from tqbench.recipe.recipe import RecipeFlags
from tqbench.testhooks import interrupt_point


class UnixUsage(TyperCommand):
    """A command whose usage line names a required argument bare (`plan [OPTIONS] SRC`), as Unix tools do, where
    Typer writes `{SRC}`."""

    def collect_usage_pieces(self, ctx: click.Context) -> list[str]:
        return [re.sub(r"^\{(.*)\}", r"\1", piece) for piece in super().collect_usage_pieces(ctx)]


class App(typer.Typer):
    """A Typer app whose commands are UnixUsage ones (and pass the interrupt test hook first)."""

    def command(self, name: str | None = None, *, cls: type[TyperCommand] | None = UnixUsage,
                **kwargs: Any) -> Callable:
        register = super().command(name, cls=cls, **kwargs)

        def wrap(command: Callable) -> Callable:
            @functools.wraps(command)
            def run(*args: Any, **values: Any) -> Any:
                interrupt_point("command")  # TQBENCH_TEST_INTERRUPT=command: Ctrl-C as the command starts
                return command(*args, **values)

            return register(run)

        return wrap


def positive(value: float | None) -> float | None:
    """A float option that must be above 0 (Typer's `min` admits it)."""
    if value is not None and value <= 0:
        raise typer.BadParameter("Input should be greater than 0")
    return value


Bits = Annotated[Optional[int], typer.Option(min=1, help="Base bits for non-expert Linears (TurboQuant 2-4).")]
GroupSize = Annotated[Optional[int], typer.Option("--group-size", "-g", min=1, help="Group size: 32, 64 or 128.")]
AttnBits = Annotated[Optional[int], typer.Option(min=1, help="Attention bits (default: --bits).")]
MlpBits = Annotated[Optional[int], typer.Option(min=1, help="Routed-expert bits (default: --bits).")]
TernaryExperts = Annotated[bool, typer.Option("--ternary-experts", help="Ternary routed experts.")]
ExpertDownBits = Annotated[Optional[int], typer.Option(min=1, help="Routed experts' down_proj bits.")]
MlpGroupSize = Annotated[Optional[int], typer.Option(min=1, help="Routed experts' group size.")]
NoRotation = Annotated[bool, typer.Option("--no-rotation", help="No Hadamard rotation.")]
Seed = Annotated[Optional[int], typer.Option(min=0, max=2**31 - 1, help="Rotation seed (default 42).")]
BaseFormat = Annotated[Optional[str], typer.Option("--format", metavar="FORMAT",
                                                   help="Base tier format: turboquant, affine or source.")]
ExpertFormat = Annotated[Optional[str], typer.Option(
    metavar="FORMAT", help="Routed-expert format: turboquant, affine, mxfp4 or source.")]
Scales = Annotated[Optional[str], typer.Option(
    "--scales", metavar="search|rms",
    help="TurboQuant group scales: searched per group for the least error (default), or the RMS alone "
         "(TurboQuant-MLX's rule).")]
Calibrate = Annotated[bool, typer.Option(
    "--calibrate", help="Calibrated rounding (recipe part cal): TurboQuant codes fitted to the source model's own "
                        "activations on calibration text. Same format and bytes.")]
ShardSize = Annotated[str, typer.Option(metavar="SIZE", help="Output shard size.")]


# ---- running a model: expert streaming and routing (chat, eval) -------------------------------------------------------

CacheBudget = Annotated[Optional[str], typer.Option(
    "--cache-budget-gb", metavar="fit|auto|off|SIZE",
    help="Stream routed experts from disk with an expert cache of SIZE (8GB, 512MB; a bare number is GB). auto: "
         "the GPU working-set limit minus the resident weights and a 3 GB reserve; fit (the default): resident "
         "when the model fits, else auto; off: resident.")]
PrefetchWorkers = Annotated[int, typer.Option("--prefetch-workers", min=1, max=256,
                                              help="Threads reading experts from disk.")]
ReadsInFlight = Annotated[int, typer.Option(
    "--reads-in-flight", metavar="N", min=0, max=256,
    help="At most N expert reads at once; the workers' copies into the cache still overlap them (0: one per "
         "worker). Some disks read one request at a time fastest.")]
CachePolicy = Annotated[str, typer.Option("--cache-policy", metavar="lrfu-next|lrfu|lru",
                                          help="Which cached expert to evict. lrfu-next also predicts each "
                                               "layer's next routing: more hits than lrfu for 2-3x its "
                                               "bookkeeping (about 12-16 ms a token at Kimi K3's scale).")]
Fanout = Annotated[bool, typer.Option("--fanout", help="Split each expert's read across the workers.")]
Lookahead = Annotated[bool, typer.Option(
    "--lookahead", help="During decode, read the next layer's likely experts (its router applied to this "
                        "layer's input) while this layer computes.")]
PageCache = Annotated[str, typer.Option(
    "--page-cache", metavar="auto|on|off",
    help="Read experts through the OS page cache (on), around it (off: O_DIRECT / F_NOCACHE), or off when the "
         "model is much larger than memory (auto).")]
HostCache = Annotated[str, typer.Option(
    "--host-cache-gb", metavar="auto|off|SIZE",
    help="A host-RAM tier under the expert cache: experts evicted from GPU memory are kept there and come back "
         "by a copy instead of a disk read. auto (the default): on CUDA, the memory free now minus a reserve; on "
         "unified memory (Apple silicon, CPU) none, the GPU's memory being the RAM. SIZE: 24GB, 512MB; a bare "
         "number is GB.")]
MaxActiveExperts = Annotated[int, typer.Option(
    "--max-active-experts", metavar="K", min=0,
    help="Route each token to K experts instead of the model's top-k (0: native). Fewer bytes per token, but it "
         "changes the model's output.")]
CacheRouting = Annotated[float, typer.Option(
    "--cache-routing", metavar="MARGIN", min=0.0, max=1.0,
    help="In decode, let the router pick an expert already in the expert cache over an uncached one whose selection "
         "score is at most MARGIN higher (streaming; kimi_k3 and deepseek_v3 routers; 0: off). Fewer misses, but it "
         "changes the model's output.")]
TrustRemoteCode = Annotated[bool, typer.Option(
    "--trust-remote-code", help="Allow the model's own tokenizer code (needed for hub ids and non-K3 models "
                                "that ship code; a local kimi_k3 directory is trusted).")]


# ---- a chat's model, sampling and profile (chat, serve) ---------------------------------------------------------------

Model = Annotated[Optional[Path], typer.Option("--model", "-m", metavar="DIR", help=(
    "Model directory: a tqbench conversion, a TurboQuant-MLX build, an MLX or source checkpoint "
    "(default: the last converted model, else the demo, converted first if needed)."))]
MaxTokens = Annotated[Optional[int], typer.Option(
    "--max-tokens", min=1, help="Most tokens per reply (default: generation_config.json's, else 512).")]
Temp = Annotated[Optional[float], typer.Option("--temp", min=0.0, help="Sampling temperature (0: greedy).")]
TopP = Annotated[Optional[float], typer.Option("--top-p", min=0.0, max=1.0, help="Nucleus sampling mass (0: off).")]
TopK = Annotated[Optional[int], typer.Option("--top-k", min=0, help="Sample among the k likeliest (0: off).")]
SamplingSeed = Annotated[Optional[int], typer.Option("--seed", min=0, max=2**64 - 1, help="Random seed for sampling.")]
ToolSyntax = Annotated[Optional[str], typer.Option(
    "--tool-syntax", metavar="sample|greedy|schema",
    help="greedy: decode tool calls' blocks greedily whatever --temp (a sampled call that breaks its format fails "
         "an agent); schema: constrain each call to an offered tool and its arguments to that tool's JSON schema. "
         "The rest of the reply is sampled as asked.")]
NoChatTemplate = Annotated[bool, typer.Option(
    "--no-chat-template", help="Send turns as plain text (a base model's continuation).")]
Profile = Annotated[Optional[Path], typer.Option(
    "--profile", metavar="FILE", help="Start from this hot-expert profile (tqbench's export, or TurboQuant-MLX's "
                                      "pin list / usage profile) instead of the learned one.")]
ProfileForce = Annotated[bool, typer.Option(
    "--profile-force", help="Use a --profile made for another model of the same layers and experts.")]
NoLearn = Annotated[bool, typer.Option("--no-learn", help="Do not learn from this session.")]
Cold = Annotated[bool, typer.Option(
    "--cold", help="Start from no profile, whatever was learned or shipped (a baseline to compare with).")]
Parallel = Annotated[str, typer.Option(
    "--parallel", metavar="pipeline|tensor",
    help="Under mlx.launch: each rank holds its own layers and streams their experts (pipeline), or a slice of "
         "every layer, experts resident (tensor: a fraction of the bytes per token on each rank, two all-sums "
         "per layer).")]
NoPromptCache = Annotated[bool, typer.Option(
    "--no-prompt-cache",
    help="Keep no prompt checkpoints on disk. By default the processing of each prompt of 256 tokens or more is kept "
         "in tqbench's cache directory, so that the same prompt, or one that extends it, continues from there in "
         "any later process.")]
PinShare = Annotated[Optional[float], typer.Option(
    "--pin-share", min=0.0, max=0.9,
    help="Share of the expert cache pinned from the profile (streaming; 0: none, the profile still ranks the "
         "cache). Default 0.5 for a learned or given profile, 0.1 for a shipped one.")]


# ---- option groups ------------------------------------------------------------------------------------------------------

@dataclass(frozen=True, kw_only=True)
class OptionGroup:
    """Options declared once for every command that takes them: (parameter name, annotated type, default) each, and
    `build`, which makes the record the command receives from their values (passed by parameter name)."""

    options: tuple[tuple[str, Any, Any], ...]
    build: Callable[..., Any]


FROM_OPTIONS: Any = None  # the default a command gives a group's parameter: @takes hands it the record instead


def takes(**groups: OptionGroup) -> Callable[[Callable], Callable]:
    """A command decorator: the command's parameter named like a group (`stream=STREAMING`) is replaced, where it
    stands in the signature Typer reads, by the group's options, and receives the record they build."""

    def wrap(command: Callable) -> Callable:
        params = []
        for p in inspect.signature(command).parameters.values():
            if p.name in groups:
                params += [inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=default, annotation=kind)
                           for name, kind, default in groups[p.name].options]
            else:
                kind = eval(p.annotation, command.__globals__) if isinstance(p.annotation, str) else p.annotation
                params.append(p.replace(kind=inspect.Parameter.KEYWORD_ONLY, annotation=kind))

        @functools.wraps(command)
        def run(**values: Any) -> Any:
            for name, group in groups.items():
                values[name] = group.build(**{option: values.pop(option) for option, _, _ in group.options})
            return command(**values)

        run.__signature__ = inspect.Signature(params)
        run.__annotations__ = {p.name: p.annotation for p in params}
        return run

    return wrap


RECIPE_FLAGS = OptionGroup(
    options=(("bits", Bits, None), ("group_size", GroupSize, None), ("attn_bits", AttnBits, None),
     ("mlp_bits", MlpBits, None), ("ternary_experts", TernaryExperts, False), ("expert_down_bits", ExpertDownBits, None),
     ("mlp_group_size", MlpGroupSize, None), ("no_rotation", NoRotation, False), ("seed", Seed, None),
     ("fmt", BaseFormat, None), ("expert_format", ExpertFormat, None), ("scales", Scales, None),
     ("calibrate", Calibrate, False)),
    build=lambda no_rotation, fmt, **flags: RecipeFlags(rotation=not no_rotation, format=fmt, **flags))

STREAMING = OptionGroup(
    options=(("cache_budget_gb", CacheBudget, None), ("prefetch_workers", PrefetchWorkers, 4),
     ("reads_in_flight", ReadsInFlight, 0), ("cache_policy", CachePolicy, "lrfu-next"), ("fanout", Fanout, False),
     ("lookahead", Lookahead, False), ("page_cache", PageCache, "auto"), ("host_cache_gb", HostCache, "auto"),
     ("cache_routing", CacheRouting, 0.0)),
    build=lambda cache_budget_gb, prefetch_workers, cache_policy, host_cache_gb, **rest: StreamRequest(
        budget=cache_budget_gb or "fit", workers=prefetch_workers, policy=cache_policy, host_budget=host_cache_gb,
        **rest))

SAMPLING = OptionGroup(
    options=(("max_tokens", MaxTokens, None), ("temp", Temp, None), ("top_p", TopP, None), ("top_k", TopK, None),
     ("seed", SamplingSeed, None), ("tool_syntax", ToolSyntax, None)),
    build=lambda **given: SamplingRequest(**given))

PROFILE = OptionGroup(
    options=(("profile", Profile, None), ("profile_force", ProfileForce, False), ("no_learn", NoLearn, False),
     ("cold", Cold, False), ("pin_share", PinShare, None)),
    build=lambda profile, profile_force, no_learn, cold, pin_share: ProfileOptions(
        file=str(profile) if profile else None, learn=not no_learn, pin_share=pin_share, force=profile_force,
        cold=cold))
