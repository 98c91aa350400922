"""The stable JSON document of an evaluation (`tqbench eval --json`, schema tqbench.eval/1)."""

from __future__ import annotations

from tqbench.eval.records import CallCheck, EvalReport, GreedyAgreement, TextScore, ToolScore

SCHEMA = "tqbench.eval/1"


def score_dict(s: TextScore) -> dict:
    return {"text": s.name, "tokens": s.tokens, "windows": s.windows, "loss": s.loss, "perplexity": s.perplexity,
            "reference_perplexity": s.ref_perplexity, "kl": s.kl, "top1_agreement": s.top1_agreement,
            "top5_overlap": s.top5_overlap, "kl_windows": list(s.kl_windows)}


def greedy_dict(g: GreedyAgreement) -> dict:
    return {"prompts": g.prompts, "generated": g.generated, "share_alike": g.share, "alike": list(g.alike),
            "same_position": list(g.same_position)}


def call_dict(c: CallCheck) -> dict:
    return {"name": c.name, "arguments": c.arguments, "valid": c.valid, "problem": c.problem, "text": c.text}


def tools_dict(t: ToolScore) -> dict:
    return {"cases": t.cases, "valid": t.valid, "valid_rate": t.valid_rate, "exact": t.exact,
            "exact_rate": t.exact_rate, "source_valid": t.source_valid, "source_exact": t.source_exact,
            "source_exact_rate": t.source_exact_rate, "agree": t.agree, "agree_rate": t.agree_rate,
            "answers": t.answers, "answered": t.answered, "answer_rate": t.answer_rate,
            "wrong_tool": t.wrong_tool, "wrong_arguments": t.wrong_arguments,
            "results": [{"case": r.where, "tool": r.tool, "call": call_dict(r.call), "exact": r.exact,
                         "source": call_dict(r.source) if r.source is not None else None, "agrees": r.agrees,
                         "answer": r.answer, "answered": r.answered} for r in t.results]}


def report_dict(r: EvalReport) -> dict:
    return {
        "schema": SCHEMA,
        "model": r.model,
        "against": r.against,
        "recipe": r.recipe,
        "window": r.window,
        "experts": {"active": r.max_active_experts, "native": r.native_experts},
        "texts": [score_dict(s) for s in r.texts],
        "total": score_dict(r.total) if r.total is not None else None,
        "greedy": greedy_dict(r.greedy) if r.greedy is not None else None,
        "layers": [{"layer": x.layer, "attention": x.attention, "mlp": x.mlp, "rel_error": x.rel_error}
                   for x in r.layers],
        "text_sha256": r.text_digest,
        "seconds": r.seconds,
        "model_bytes": r.model_bytes,
        "read_bytes": {"model": r.model_read_bytes, "against": r.against_read_bytes},
        "routing_changed": r.routing_changed,
        "cache_routing": r.cache_routing,
        "decode": r.decode,
        "per_token": {"misses": r.model_misses_per_token, "substitutions": r.model_substitutions_per_token},
        "tiers": r.model_tiers.to_dict() if r.model_tiers else None,
        "tools": tools_dict(r.tools) if r.tools is not None else None,
    }
