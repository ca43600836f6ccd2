"""Regenerate the "Parameters" section of docs/operators.md from the stage declarations.

    .venv/bin/python scripts/operator_params.py        # rewrites the section in place

Each built-in stage's params (`rlgraph.ops.stages`) as a table: key, type, default, meaning (the
Param's doc, its choices, and whether a worker reads it once at start-up). tests/test_docs.py
checks that every key is listed.
"""

from __future__ import annotations

from pathlib import Path

from rlgraph.ops import stages

DOC = Path(__file__).resolve().parents[1] / "docs" / "operators.md"
HEAD = "## Parameters\n"


def _table(title: str, namespace: str, params: dict) -> str:
    rows = [f"### {title} (`{namespace}.*`)", "", "| key | type | default | meaning |", "|---|---|---|---|"]
    for k, p in params.items():
        doc = p.doc + (f" (one of {', '.join(map(str, p.choices))})" if p.choices else "")
        doc += " (read once, when the worker starts)" if p.setup else ""
        default = '""' if p.default == "" else repr(p.default)
        rows.append(f"| `{namespace}.{k}` | {p.type_name} | `{default}` | {doc.replace('|', '&#124;')} |")
    return "\n".join(rows) + "\n"


def section() -> str:
    specs = [("generate", stages.generate()),
             ("agent_rollout (its own keys; the generate keys above apply too)", stages.agent_rollout()),
             ("env_reward", stages.env_reward()), ("reward", stages.reward()), ("reward_model", stages.reward_model()),
             ('combine_rewards, with weights {"rule_scores": 1.0, "rm_scores": 0.5}',
              stages.combine_rewards({"rule_scores": 1.0, "rm_scores": 0.5})),
             ("overlong_penalty", stages.overlong_penalty()), ("filter_groups", stages.filter_groups()),
             ("old_logprob", stages.old_logprob()), ("ref", stages.ref()), ("values", stages.values()),
             ("advantage", stages.advantage("gae")), ("update_critic", stages.update_critic()),
             ("update_actor", stages.update_actor())]
    parts = [HEAD, "Generated from the declarations by `scripts/operator_params.py` (`tests/test_docs.py` checks "
             "that every key is listed).\n", _table("data source", "data", dict(stages.prompt_source().params))]
    generate = stages.generate().params
    parts += [_table(title, spec.namespace, {k: v for k, v in spec.params.items()
                                             if not (title.startswith("agent_rollout") and k in generate)})
              for title, spec in specs]
    return "\n".join(parts)


def main() -> None:
    text = DOC.read_text()
    DOC.write_text(text[:text.index(HEAD)] + section())


if __name__ == "__main__":
    main()
