"""The built-in prompt source: verl's parquet/JSONL layout, tokenised with a chat template.

A row of the file (verl's layout, as `rlgraph.ops.data.tasks` writes it)::

    {"prompt": [{"role": "user", "content": "3+4="}], "data_source": "add",
     "reward_model": {"ground_truth": "7"}, "extra_info": {"index": 0}}

becomes one prompt of a batch: ``prompt_ids`` (the chat template applied with the generation
prompt, as an int64 tensor), ``data_source``, ``ground_truth`` (scalars become strings, lists
and dicts JSON), ``extra_info`` (a dict; ``{}`` when absent). ``prompt`` may also be a plain
string, taken as one user message.

Reading (`read_table_rows`): with Ray Data (``ray.data.read_parquet`` / ``read_json``) when
Ray is initialised in the process, which it is inside the source actor, and has a CPU free for
Ray Data's listing task (else that task would wait forever on a cluster whose CPUs the worker
groups hold). Without Ray (scripts, unit tests) the file is read locally: pyarrow for parquet,
Python's json line by line for JSONL; ``data.reader`` picks one explicitly. The whole file is
read and tokenised at start-up, as verl does: prompt sets are small next to the cost of one RL
step, and the checks below then cover every row.

Checks, all at start-up: every row problem (missing field, empty prompt, bad message) is
collected and raised once as a `PromptDataError` naming the rows and the fix. Prompts longer
than ``max_prompt_length`` tokens are dropped and counted (`PromptSource.num_filtered`, and a
warning) when ``filter_overlong_prompts`` is true, as verl's flag of that name does; otherwise
they are a `PromptTooLongError` naming the row, its length and the limit.

Order: each epoch is a permutation of the rows seeded by ``(seed, epoch)`` (or file order when
``shuffle`` is false); a batch that runs past the end continues into the next epoch. The read
position ``{"epoch", "offset", "val_offset"}`` is the state saved with checkpoints, so a
resumed run reads exactly the prompts it would have read.

With an empty ``path`` the rows are generated: ``num_rows`` train rows of the built-in task
``task``, and ``num_val_rows`` rows of its test split for validation (disjoint prompts).
"""

from __future__ import annotations

import itertools
import json
import random
import warnings
from pathlib import Path
from typing import Any, Iterable, Iterator, Mapping, Sequence

import torch

from rlgraph.errors import RLGraphError
from rlgraph.ops.models import CHAR_TOKENIZER, tokenizer_at
from rlgraph.ops.settings import ActorSettings, DataSettings

__all__ = ["PromptDataError", "PromptTooLongError", "PromptSource", "read_table_rows", "tokenizer_path"]

_MAX_LISTED = 10  # problems listed in one error; the count of the rest follows


class PromptDataError(RLGraphError, ValueError):
    """The prompt file is missing, unreadable, or has rows that do not follow verl's layout."""


class PromptTooLongError(PromptDataError):
    """A prompt is longer than ``data.max_prompt_length`` and filtering is off."""


def _ray_initialized() -> bool:
    try:
        import ray
    except ImportError:  # pragma: no cover - ray is a dependency
        return False
    return ray.is_initialized()


def _ray_has_free_cpu() -> bool:
    import ray

    return ray.available_resources().get("CPU", 0.0) >= 1.0


def read_table_rows(path: str | Path, reader: str = "auto") -> list[dict[str, Any]]:
    """The rows of a ``.parquet`` or ``.jsonl`` file, in file order, as plain Python dicts.

    `reader`: ``"ray"`` (Ray Data; Ray must be initialised), ``"local"`` (pyarrow for parquet,
    Python's json line by line for JSONL, so rows may differ in their fields' types), or
    ``"auto"``: Ray Data when Ray is initialised in this process and has a free CPU, else
    local. Reading never starts Ray. Ray Data's file-listing task needs one CPU whatever its
    read tasks ask for, so on a cluster whose CPUs are all reserved it would wait forever;
    ``auto`` checks first, and a Ray read still unfinished after `RAY_READ_TIMEOUT_S` falls
    back to the local reader with a warning instead of hanging; a file Ray Data cannot parse
    (rows whose fields differ in type, a malformed row) is read locally too.
    """
    p = Path(path).expanduser()
    if not p.is_file():
        raise PromptDataError(f"prompt file {str(p)!r} does not exist; give a parquet or JSONL file in verl's "
                              f"layout (write one with rlgraph.ops.data.tasks.write_task)")
    kind = "parquet" if p.suffix == ".parquet" else "json" if p.suffix in (".jsonl", ".json") else None
    if kind is None:
        raise PromptDataError(f"prompt file {str(p)!r} has extension {p.suffix!r}; use .parquet or .jsonl")
    if reader not in ("auto", "ray", "local"):
        raise PromptDataError(f"data.reader={reader!r}; use 'auto', 'ray' or 'local'")
    if reader == "ray" and not _ray_initialized():
        raise PromptDataError("data.reader='ray' needs Ray initialised in this process; call ray.init() first or "
                              "set data.reader=auto")
    if reader == "ray" or (reader == "auto" and _ray_initialized() and _ray_has_free_cpu()):
        try:
            rows = _read_with_ray(p, kind)
        except Exception as e:  # Ray Data wraps pyarrow's errors in its own types
            if reader == "auto":
                # Ray Data needs one schema for the whole file; the local reader takes rows whose
                # fields differ in type, and names the exact rows and fields of a malformed file
                return _read_locally(p, kind)
            raise PromptDataError(f"Ray Data cannot read prompt file {str(p)!r} as {kind}: {type(e).__name__}: {e}"
                                  f"\nfix: give every row's fields the same types, or set data.reader=local "
                                  f"(reads JSONL line by line)") from e
        if rows is not None:
            return rows
    return _read_locally(p, kind)


RAY_READ_TIMEOUT_S = 60.0
PREFLIGHT_ROWS = 64  # rows `PromptSource.preflight` reads from the head of each file


def read_first_rows(path: str | Path, n: int = PREFLIGHT_ROWS) -> list[dict[str, Any]]:
    """The first `n` rows of a ``.parquet`` or ``.jsonl`` file, read locally without reading the
    rest (parquet: the first record batch; JSONL: the first lines)."""
    p = Path(path).expanduser()
    if not p.is_file():
        raise PromptDataError(f"prompt file {str(p)!r} does not exist; give a parquet or JSONL file in verl's "
                              f"layout (write one with rlgraph.ops.data.tasks.write_task)")
    if p.suffix == ".parquet":
        import pyarrow.parquet as pq

        try:
            batch = next(pq.ParquetFile(p).iter_batches(batch_size=n), None)
        except Exception as e:  # pyarrow raises several types for a malformed file; name the file once
            raise PromptDataError(f"cannot read prompt file {str(p)!r} as parquet: {type(e).__name__}: {e}") from e
        return batch.to_pylist() if batch is not None else []
    if p.suffix not in (".jsonl", ".json"):
        raise PromptDataError(f"prompt file {str(p)!r} has extension {p.suffix!r}; use .parquet or .jsonl")
    with p.open() as f:
        return list(itertools.islice(_json_rows(p, f), n))


def _json_rows(path: Path, lines: Iterable[str]) -> Iterator[dict[str, Any]]:
    """The JSON object of each non-blank line of JSONL file `path`, in order; a line that is not one
    is a `PromptDataError` naming it."""
    for line_no, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise PromptDataError(f"{str(path)!r} line {line_no} is not valid JSON ({e}); JSONL holds one JSON "
                                  f"object per line") from None
        if not isinstance(row, dict):
            raise PromptDataError(f"{str(path)!r} line {line_no} is a JSON {type(row).__name__}, not an object; "
                                  f"JSONL holds one object (one prompt row) per line")
        yield row


def _read_locally(path: Path, kind: str) -> list[dict[str, Any]]:
    if kind == "json":
        return list(_json_rows(path, path.read_text().splitlines()))
    import pyarrow.parquet as pq

    try:
        return pq.read_table(path).to_pylist()
    except Exception as e:  # pyarrow raises several types for a malformed file; name the file once
        raise PromptDataError(f"cannot read prompt file {str(path)!r} as parquet: {type(e).__name__}: {e}") from e


def _read_with_ray(path: Path, kind: str) -> list[dict[str, Any]] | None:
    """The file's rows, read by Ray Data on this node; None after the timeout."""
    import concurrent.futures

    import pyarrow as pa
    import ray
    import ray.data

    def read() -> list:
        ctx = ray.data.DataContext.get_current()
        ctx.execution_options.preserve_order = True  # row indices in errors are file positions
        uri = f"local://{path.resolve()}"
        with warnings.catch_warnings():
            # Ray 2.60 deprecates local:// in favour of shared storage; the file is local to
            # the source actor here, which is exactly what local:// means
            warnings.filterwarnings("ignore", message=".*local://.*")
            # num_cpus=0: the read tasks do not compete with the worker groups for CPUs
            ds = ray.data.read_parquet(uri, num_cpus=0) if kind == "parquet" else ray.data.read_json(uri, num_cpus=0)
        return [t for t in ray.get(ds.to_arrow_refs()) if t.num_rows]

    pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="rlgraph-ray-read")
    try:
        tables = pool.submit(read).result(timeout=RAY_READ_TIMEOUT_S)
    except concurrent.futures.TimeoutError:
        warnings.warn(f"Ray Data did not read {str(path)!r} within {RAY_READ_TIMEOUT_S:.0f} s (no free CPU for its "
                      f"listing task?); reading it locally instead. Set data.reader=local to skip Ray Data",
                      stacklevel=3)
        return None
    finally:
        pool.shutdown(wait=False)
    return pa.concat_tables(tables, promote_options="default").to_pylist() if tables else []


def _messages(prompt: Any) -> list[dict[str, str]] | str:
    """The chat messages of a row's ``prompt``, or a string saying what is wrong with it."""
    if isinstance(prompt, str):
        prompt = [{"role": "user", "content": prompt}]
    if not isinstance(prompt, (list, tuple)):
        return f"'prompt' is a {type(prompt).__name__}; give a list of {{'role', 'content'}} messages"
    out = []
    for j, m in enumerate(prompt):
        if not isinstance(m, Mapping) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            return f"message {j} of 'prompt' is {_short(m)}; each message needs a string 'role' and 'content'"
        out.append({"role": m["role"], "content": m["content"]})
    if not any(m["content"].strip() for m in out):
        what = "no messages" if not out else "no message has any content"
        return f"empty prompt ({what}); give the question as the user message's content"
    return out


def _short(value: Any, limit: int = 80) -> str:
    """`repr` of a value from a data file, cut to `limit` characters for an error message."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _ground_truth(row: Mapping[str, Any]) -> str | None:
    rm = row.get("reward_model")
    gt = rm.get("ground_truth") if isinstance(rm, Mapping) else None
    if gt is None:
        return None
    return gt if isinstance(gt, str) else json.dumps(gt) if isinstance(gt, (list, dict)) else str(gt)


class PromptSource:
    """verl-layout prompts (parquet/JSONL or a generated built-in task), tokenised; see the module doc.

    `config` holds the ``data.*`` values of `rlgraph.ops.stages.prompt_source`
    (`rlgraph.ops.settings.DataSettings`; a missing key takes its default). `seed` (``trainer.seed``)
    seeds the shuffle and generated rows.
    """

    def __init__(self, config: Mapping[str, Any], seed: int, plan_config: Mapping[str, Any] | None = None) -> None:
        cfg = DataSettings.read(config)
        self.seed = int(seed)
        self.shuffle = cfg.shuffle
        self.max_prompt_length = cfg.max_prompt_length
        self.filter_overlong = cfg.filter_overlong_prompts
        self.tokenizer_path = tokenizer_path(cfg.tokenizer, plan_config)
        self.tokenizer = tokenizer_at(self.tokenizer_path)
        self.num_filtered = 0  # overlong prompts dropped (train and validation files together)
        self.num_unknown = 0  # prompt tokens the tokenizer does not know (its <unk>), over every row read
        self._batch_unknown = 0  # in the latest batch handed out

        if cfg.path:
            train_rows = read_table_rows(cfg.path, cfg.reader)
            train_name = cfg.path
        else:
            from rlgraph.ops.data.tasks import make_rows

            train_rows = make_rows(cfg.task, cfg.num_rows, self.seed, "train")
            train_name = f"generated task {cfg.task!r}"
        self._rows = self._prepare(train_rows, train_name)

        self._val_rows: list[tuple] | None = None
        if cfg.val_path:
            self._val_rows = self._prepare(read_table_rows(cfg.val_path, cfg.reader), cfg.val_path)
        elif not cfg.path:
            from rlgraph.ops.data.tasks import make_rows

            rows = make_rows(cfg.task, cfg.num_val_rows, self.seed, "test")
            self._val_rows = self._prepare(rows, f"generated task {cfg.task!r} (test split)")

        self.epoch, self.offset, self.val_offset = 0, 0, 0
        self._order = self._permutation(0)

    def _prepare(self, rows: Sequence[Mapping[str, Any]], name: str) -> list[tuple]:
        """Check and tokenise every row; raise once with every problem found (rows numbered
        from 0 in file order)."""
        if not rows:
            raise PromptDataError(f"{name} has no rows; give a file with at least one prompt")
        present = set().union(*(r.keys() for r in rows))
        absent = [k for k in ("prompt", "data_source", "reward_model") if k not in present]
        if absent:
            raise PromptDataError(f"{name} has no {', '.join(repr(k) for k in absent)} field in any row (it has "
                                  f"{sorted(present)}); write verl's layout: prompt (chat messages), data_source, "
                                  f"reward_model.ground_truth, optional extra_info")
        problems: list[str] = []
        checked: list[tuple[int, list[dict[str, str]], str, str, dict]] = []
        for i, row in enumerate(rows):
            missing = [k for k in ("prompt", "data_source") if row.get(k) is None]
            rm = row.get("reward_model")
            if rm is not None and not isinstance(rm, Mapping):
                problems.append(f"row {i}: 'reward_model' is {_short(rm)}, not a dict; write "
                                f"\"reward_model\": {{\"ground_truth\": ...}}")
                continue
            gt = _ground_truth(row)
            if gt is None:
                missing.append("reward_model.ground_truth")
            if missing:
                problems.append(f"row {i}: missing {', '.join(repr(m) for m in missing)}")
                continue
            messages = _messages(row["prompt"])
            if isinstance(messages, str):
                problems.append(f"row {i}: {messages}")
                continue
            extra = row.get("extra_info")
            if extra is None:
                extra = {}
            if not isinstance(extra, Mapping):
                problems.append(f"row {i}: 'extra_info' is a {type(extra).__name__}; give a dict (or leave it out)")
                continue
            checked.append((i, messages, str(row["data_source"]), gt, dict(extra)))
        if problems:
            raise PromptDataError(_listing(f"{name}: {len(problems)} row(s) do not follow verl's layout "
                                           f"(prompt: chat messages, data_source, reward_model.ground_truth, "
                                           f"optional extra_info); rows are counted from 0 in file order",
                                           problems, "correct or remove these rows"))
        # one template call and one batched (Rust) encode for all rows: the same ids as
        # models.encode_prompt gives one row at a time, much faster for large files
        encoded = self._encode(checked, name)
        too_long: list[str] = []
        out: list[tuple] = []
        filtered = 0
        unk = getattr(self.tokenizer, "unk_token_id", None)
        unknown = [sum(1 for t in ids if t == unk) if unk is not None else 0 for ids in encoded]
        if any(unknown):
            rows_with = [i for (i, *_), n in zip(checked, unknown) if n]
            self.num_unknown += sum(unknown)
            warnings.warn(f"{name}: {sum(unknown)} prompt token(s) in {len(rows_with)} row(s) (first: row "
                          f"{rows_with[0]}) are characters the tokenizer {self.tokenizer_path!r} does not know, "
                          f"encoded as {self.tokenizer.unk_token!r}; the metric data/unknown_tokens counts them per "
                          f"step. Use the policy's own tokenizer (data.tokenizer empty: actor.model_path's)",
                          stacklevel=3)
        for (i, _, data_source, gt, extra), ids, n_unk in zip(checked, encoded, unknown):
            if len(ids) > self.max_prompt_length:
                if self.filter_overlong:
                    filtered += 1
                else:
                    too_long.append(f"row {i}: {len(ids)} tokens")
                continue
            out.append((torch.tensor(ids, dtype=torch.int64), data_source, gt, extra, n_unk))
        if too_long:
            raise PromptTooLongError(_listing(
                f"{name}: {len(too_long)} prompt(s) are longer than data.max_prompt_length={self.max_prompt_length}",
                too_long, "raise data.max_prompt_length, or set data.filter_overlong_prompts=true to drop them"))
        if filtered:
            self.num_filtered += filtered
            warnings.warn(f"{name}: dropped {filtered} of {len(rows)} prompts longer than "
                          f"data.max_prompt_length={self.max_prompt_length} tokens", stacklevel=3)
        if not out:
            raise PromptTooLongError(f"{name}: all {len(rows)} prompts are longer than data.max_prompt_length="
                                     f"{self.max_prompt_length} tokens; raise data.max_prompt_length")
        return out

    def _encode(self, checked: list[tuple], name: str) -> list[list[int]]:
        """Token ids of every checked row: its messages through the chat template, then the tokenizer.
        A failure (a template that rejects a role, a message order) names the first failing row."""
        try:
            texts = self.tokenizer.apply_chat_template([c[1] for c in checked], add_generation_prompt=True,
                                                       tokenize=False)
            return self.tokenizer(list(texts), add_special_tokens=False)["input_ids"]
        except Exception as batch_error:  # the template raises jinja's or the tokenizer's own types
            for i, messages, *_ in checked:  # find the row, one at a time (only on this error path)
                try:
                    text = self.tokenizer.apply_chat_template([messages], add_generation_prompt=True, tokenize=False)
                    self.tokenizer(list(text), add_special_tokens=False)
                except Exception as e:
                    raise PromptDataError(
                        f"{name}: row {i}: the tokenizer cannot encode its prompt {_short(messages)} "
                        f"({type(e).__name__}: {e})\nfix: give messages the chat template accepts (roles such as "
                        f"'system', 'user', 'assistant'), or set data.tokenizer to a tokenizer with a suitable "
                        f"chat template") from None
            raise PromptDataError(f"{name}: the tokenizer cannot encode the prompts ({type(batch_error).__name__}: "
                                  f"{batch_error})\nfix: check data.tokenizer and its chat template") from None

    def _permutation(self, epoch: int) -> list[int]:
        order = list(range(len(self._rows)))
        if self.shuffle:
            random.Random(f"rlgraph-prompts/{self.seed}/{epoch}").shuffle(order)
        return order

    @property
    def num_rows(self) -> int:
        """Prompts per epoch (after filtering)."""
        return len(self._rows)

    def _batch(self, rows: Sequence[tuple]) -> dict[str, list]:
        self._batch_unknown = sum(r[4] for r in rows)
        return {"prompt_ids": [r[0].clone() for r in rows], "data_source": [r[1] for r in rows],
                "ground_truth": [r[2] for r in rows], "extra_info": [dict(r[3]) for r in rows]}

    def next_batch(self, batch_size: int) -> dict[str, list]:
        """The next `batch_size` prompts; continues into the next epoch (reshuffled) at the end."""
        picked = []
        for _ in range(batch_size):
            if self.offset >= len(self._order):
                self.epoch, self.offset = self.epoch + 1, 0
                self._order = self._permutation(self.epoch)
            picked.append(self._rows[self._order[self.offset]])
            self.offset += 1
        return self._batch(picked)

    def next_val_batch(self, batch_size: int) -> dict[str, list]:
        """The next `batch_size` validation prompts, in file order, wrapping around."""
        if self._val_rows is None:
            raise PromptDataError("validation needs data.val_path (a parquet or JSONL file of prompts); set it, "
                                  "or set trainer.val_every=0")
        picked = []
        for _ in range(batch_size):
            picked.append(self._val_rows[self.val_offset % len(self._val_rows)])
            self.val_offset = (self.val_offset + 1) % len(self._val_rows)
        return self._batch(picked)

    @classmethod
    def preflight(cls, config: Mapping[str, Any], seed: int, plan_config: Mapping[str, Any] | None = None
                  ) -> list[str]:
        """What `rlgraph validate` (and `rlgraph run`, before it waits for its workers) checks without
        starting anything: the tokenizer (it exists, and its vocabulary fits the policy's embedding)
        and the head of each prompt file (it exists, has verl's fields, and its first rows check and
        encode). Raises `PromptDataError`; returns notes on what could not be checked yet."""
        cfg = DataSettings.read(config)
        notes: list[str] = []
        path = tokenizer_path(cfg.tokenizer, plan_config)
        model = Path(_model_path(plan_config)).expanduser() if _model_path(plan_config) else None
        tokenizer = None
        if path != CHAR_TOKENIZER and not Path(path).expanduser().exists():
            if cfg.tokenizer:  # named by the user: it must be there
                raise PromptDataError(f"data.tokenizer {path!r} does not exist; give the policy's HF directory, or "
                                      f"leave data.tokenizer empty for actor.model_path's tokenizer")
            notes.append(f"the tokenizer of actor.model_path {path!r} is not checked: the directory does not exist "
                         f"yet (the pipeline's prepare hook builds it when the run starts)")
        else:
            tokenizer = tokenizer_at(path)
        if tokenizer is not None and model is not None and (model / "config.json").is_file():
            vocab = _vocab_size(model / "config.json")
            if vocab is not None and len(tokenizer) > vocab:
                raise PromptDataError(
                    f"data.tokenizer {path!r} has {len(tokenizer)} tokens, but the policy in actor.model_path "
                    f"{str(model)!r} has an embedding of {vocab} rows (vocab_size): token ids >= {vocab} would "
                    f"index past it; use the policy's own tokenizer (leave data.tokenizer empty)")
        for key, file in (("data.path", cfg.path), ("data.val_path", cfg.val_path)):
            if not file:
                continue
            rows = read_first_rows(file)
            name = f"{key} {file!r} (first {len(rows)} rows)"
            if tokenizer is None:
                cls._check_fields(rows, name)
                continue
            probe = cls.__new__(cls)
            probe.tokenizer, probe.tokenizer_path = tokenizer, path
            probe.max_prompt_length, probe.num_filtered, probe.num_unknown = cfg.max_prompt_length, 0, 0
            probe.filter_overlong = cfg.filter_overlong_prompts
            try:
                probe._prepare(rows, name)
            except PromptTooLongError:
                if not cfg.filter_overlong_prompts:
                    raise  # with filtering on, the head's rows may all be long and later ones not
        return notes

    @staticmethod
    def _check_fields(rows: Sequence[Mapping[str, Any]], name: str) -> None:
        if not rows:
            raise PromptDataError(f"{name} has no rows; give a file with at least one prompt")
        present = set().union(*(r.keys() for r in rows))
        absent = [k for k in ("prompt", "data_source", "reward_model") if k not in present]
        missing_gt = [i for i, r in enumerate(rows) if _ground_truth(r) is None]
        if absent or missing_gt:
            what = (f"no {', '.join(repr(k) for k in absent)} field" if absent
                    else f"no reward_model.ground_truth in row(s) {missing_gt[:5]}")
            raise PromptDataError(f"{name} has {what}; write verl's layout: prompt (chat messages), data_source, "
                                  f"reward_model.ground_truth, optional extra_info")

    def batch_metrics(self) -> dict[str, float]:
        """Metrics of the latest batch handed out (the step's record has them as ``data/<name>``)."""
        return {"unknown_tokens": float(self._batch_unknown)}

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "offset": self.offset, "val_offset": self.val_offset}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        try:
            epoch, offset = int(state["epoch"]), int(state["offset"])
        except (KeyError, TypeError, ValueError) as e:
            raise PromptDataError(f"the prompt source's saved position {_short(state)} is not "
                                  f"{{'epoch': int, 'offset': int, 'val_offset': int}} ({type(e).__name__}: {e}); the "
                                  f"checkpoint is damaged or from another data source: resume from another "
                                  f"checkpoint, or start without --resume") from None
        if epoch < 0 or not 0 <= offset <= len(self._rows):
            raise PromptDataError(f"cannot resume the prompt source at epoch={epoch}, offset={offset}: this data "
                                  f"has {len(self._rows)} prompts per epoch; resume with the same data.path")
        self.epoch, self.offset = epoch, offset
        self.val_offset = int(state.get("val_offset", 0)) % max(1, len(self._val_rows or ()))
        self._order = self._permutation(epoch)


def _vocab_size(config_json: Path) -> int | None:
    """The embedding rows of the model whose config.json this is (``vocab_size``, also under
    ``text_config`` for multimodal configs); None when it does not say."""
    try:
        cfg = json.loads(config_json.read_text())
    except (OSError, ValueError):
        return None
    for c in (cfg, cfg.get("text_config") or {}):
        if isinstance(c.get("vocab_size"), int):
            return int(c["vocab_size"])
    return None


def _model_path(plan_config: Mapping[str, Any] | None) -> str:
    """actor.model_path of a plan's nested config ("" when it has no actor section)."""
    actor = (plan_config or {}).get("actor")
    return ActorSettings.read(actor).model_path if isinstance(actor, Mapping) else ""


def tokenizer_path(tokenizer: str, plan_config: Mapping[str, Any] | None) -> str:
    """What ``data.tokenizer`` names: itself when set (a directory, or ``char``), else the policy's
    own, ``actor.model_path`` of the plan's config."""
    if tokenizer:
        return tokenizer
    model = _model_path(plan_config)
    if not model:
        raise PromptDataError("data.tokenizer is empty and the pipeline has no actor.model_path to take the "
                              "tokenizer from; set data.tokenizer to the policy's HF directory, or "
                              "data.tokenizer=char for the built-in character tokenizer of the tiny models")
    return str(model)


def _listing(head: str, items: list[str], fix: str | None = None) -> str:
    lines = [head + ":"] + [f"  {s}" for s in items[:_MAX_LISTED]]
    if len(items) > _MAX_LISTED:
        lines.append(f"  ... and {len(items) - _MAX_LISTED} more")
    if fix:
        lines.append(f"fix: {fix}")
    return "\n".join(lines)
