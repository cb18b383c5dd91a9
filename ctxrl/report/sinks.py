"""Where a run's metrics go besides its JSONL files: TensorBoard and Weights & Biases (``report.sinks``).

``metrics.jsonl`` and ``samples.jsonl`` are always written (``RunWriter``): they are the record a
resumed run rewinds and the plots are drawn from. A sink is a second audience for the same rows,
where practitioners look while a run goes on:

- ``tensorboard``: scalars under ``rl/...``, ``eval/<split>/...`` and ``sft/...`` at each row's
  step, and sample episodes as text (``samples/<phase>``), their trained tokens (loss mask 1)
  set in bold so the mask is visible. Event files in ``RUN/tensorboard``; ``tensorboard --logdir
  runs`` shows every run. A resumed run purges the steps it redoes.
- ``wandb``: the same scalars and a table of sample episodes per step, in ``RUN/wandb``. Offline by
  default (``report.wandb_mode``): it needs no account, and ``wandb sync RUN/wandb/offline-run-*``
  uploads it later. A resumed run's earlier steps are not rewritten (W&B keeps steps increasing).

A sink is a small class with ``log_metrics(row)``, ``log_samples(records)``, ``rewind(step)`` and
``close()``. Each is imported only when chosen; a chosen sink whose package is missing is a
``ConfigError`` naming what to install.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Protocol

from ctxrl.errors import ConfigError

SINKS = ("jsonl", "tensorboard", "wandb")
"""Valid names in ``report.sinks`` (``jsonl`` is always on)."""


class Sink(Protocol):
    def log_metrics(self, row: dict[str, Any]) -> None:
        """One metrics row (``phase``, ``step``, ``split`` for evaluations, then figures)."""

    def log_samples(self, records: list[dict[str, Any]]) -> None:
        """Decoded sample episodes (``ctxrl.report.writer.episode_record``), all of one step and phase."""

    def rewind(self, step: int) -> None:
        """A resumed run goes on after ``step``: what was logged past it will be logged again."""

    def close(self) -> None:
        """Flush and let go."""


def sink_names(text: str) -> list[str]:
    """The names of a ``report.sinks`` value (``jsonl`` first, always)."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in SINKS]
    if unknown:
        raise ConfigError(f"report.sinks: unknown sink {unknown[0]!r}; choose from {', '.join(SINKS)} "
                          "(comma-separated)")
    return ["jsonl", *(n for n in dict.fromkeys(names) if n != "jsonl")]


def make_sinks(settings: Any, run_dir: Path, *, name: str = "run", config: dict | None = None) -> list[Sink]:
    """The sinks a ``[report]`` section asks for, besides the JSONL files (``RunWriter``)."""
    sinks: list[Sink] = []
    for sink in sink_names(settings.sinks)[1:]:
        if sink == "tensorboard":
            sinks.append(TensorBoardSink(run_dir / "tensorboard"))
        elif sink == "wandb":
            sinks.append(WandbSink(run_dir, project=settings.wandb_project, mode=settings.wandb_mode, name=name,
                                   config=config))
    return sinks


def scalars(row: dict[str, Any]) -> tuple[str, int, dict[str, float]] | None:
    """(tag prefix, step, numeric figures) of a metrics row; None for rows that are not figures."""
    phase = row.get("phase")
    if phase == "rl":
        prefix = "rl/"
    elif phase == "eval":
        prefix = f"eval/{row.get('split', 'all')}/"
    elif phase == "sft":
        prefix = "sft/"
    else:
        return None
    values = {k: float(v) for k, v in row.items()
              if k not in ("phase", "step", "split") and isinstance(v, (int, float)) and not isinstance(v, bool)}
    values.update({k: float(v) for k, v in row.items() if isinstance(v, bool) and k not in ("phase", "step")})
    return prefix, int(row.get("step", 0)), values


def episode_markdown(record: dict[str, Any]) -> str:
    """A sample episode as Markdown: a header line, then its text with trained tokens (mask 1) in bold."""
    head = (f"**{record['phase']}** task `{record['task_id']}` ({record['split']}): reward {record['reward']:g}, "
            f"success {record['success']}, truncation {record['truncation']}, tool calls {record['tool_calls']}")
    if record.get("error"):
        head += f", error: {record['error']}"

    def body(spans: list[dict]) -> str:
        out = []
        for span in spans:
            text = span["text"].replace("\n", "  \n")
            out.append(f"**{text}**" if span["mask"] and text.strip() else text)
        return "".join(out)

    parts = [head]
    for k, segment in enumerate(record.get("segments", [])):
        parts.append(f"*segment {k + 1}, ended by {segment['ended_by']}:*  \n" + body(segment["spans"]))
    parts.append(body(record["spans"]))
    return "\n\n".join(parts)


class TensorBoardSink:
    """Scalars and sample episodes as TensorBoard event files (``torch.utils.tensorboard``)."""

    def __init__(self, log_dir: Path) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as exc:
            raise ConfigError(f"report.sinks has tensorboard, but it cannot be imported ({exc}); "
                              "pip install -e '.[tensorboard]' or remove it from report.sinks") from None
        self._writer_cls, self.log_dir = SummaryWriter, log_dir
        self.writer = SummaryWriter(log_dir=str(log_dir))

    def log_metrics(self, row: dict[str, Any]) -> None:
        found = scalars(row)
        if found is None:
            return
        prefix, step, values = found
        for key, value in values.items():
            if math.isfinite(value):
                self.writer.add_scalar(prefix + key, value, step)
        self.writer.flush()

    def log_samples(self, records: list[dict[str, Any]]) -> None:
        if records:
            text = "\n\n---\n\n".join(episode_markdown(r) for r in records)
            self.writer.add_text(f"samples/{records[0]['phase']}", text, records[0]["step"])
            self.writer.flush()

    def rewind(self, step: int) -> None:
        self.writer.close()  # events after ``step`` are the resumed run's to write again
        self.writer = self._writer_cls(log_dir=str(self.log_dir), purge_step=step + 1)

    def close(self) -> None:
        self.writer.close()


class WandbSink:
    """Scalars and a table of sample episodes in a Weights & Biases run (offline unless asked otherwise)."""

    def __init__(self, run_dir: Path, *, project: str, mode: str, name: str, config: dict | None) -> None:
        try:
            import wandb
        except ImportError as exc:
            raise ConfigError(f"report.sinks has wandb, but it cannot be imported ({exc}); "
                              "pip install -e '.[wandb]' or remove it from report.sinks") from None
        self.wandb = wandb
        self.run = wandb.init(project=project, name=name, dir=str(run_dir), mode=mode, config=config or {},
                              reinit="create_new")
        self._step = -1

    def log_metrics(self, row: dict[str, Any]) -> None:
        found = scalars(row)
        if found is None:
            return
        prefix, step, values = found
        if step < self._step:  # W&B keeps steps increasing: a resumed run's redone steps are left out
            return
        self._step = step
        self.run.log({prefix + k: v for k, v in values.items()}, step=step)

    def log_samples(self, records: list[dict[str, Any]]) -> None:
        if not records or records[0]["step"] < self._step:
            return
        table = self.wandb.Table(columns=["task", "split", "reward", "success", "episode"],
                                 data=[[r["task_id"], r["split"], r["reward"], r["success"], episode_markdown(r)]
                                       for r in records])
        self._step = records[0]["step"]
        self.run.log({f"samples/{records[0]['phase']}": table}, step=self._step)

    def rewind(self, step: int) -> None:
        self._step = max(self._step, step)

    def close(self) -> None:
        self.run.finish()
