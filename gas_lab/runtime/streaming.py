"""What the ranks print, shown in the cell while they run.

Each rank's ``print`` reaches the notebook as it happens (ipyparallel forwards the ranks' output
streams to the notebook process), one line at a time, prefixed with the rank. A line a rank
keeps rewriting with a carriage return (a ``tqdm`` progress bar) is shown as one live line that
updates in place, not as hundreds of lines. Output is capped per rank and call, with a note,
so a runaway ``print`` cannot flood the notebook.

Why not ipyparallel's own ``%%px --stream`` (9.2, measured in a kernel, 2 engines): a
``tqdm.auto`` bar stays at "0%" on each engine (the engines send a widget the notebook cannot
show), and each chunk of output re-sends everything the engine printed so far, with no cap:
300,000 characters per engine reached the browser as 602 messages and 89 MB. The same cells
here: one live line per rank that ends at 100% (22 messages, 4 KB), and 430 KB with the cap.
"""

from __future__ import annotations

import re
import sys
import time

OUTPUT_LIMIT = 200_000  # characters per rank per call shown in the notebook
BAR_REFRESH = 0.2  # seconds between two updates of a live line

# Harmless lines DeepSpeed prints on a CPU-only machine while probing optional features
# (async I/O needs libaio), its warning for the SGD the lessons allow on purpose
# (zero_allow_untested_optimizer), the memory report its BF16_Optimizer prints at every start,
# and "built successfully" at every load of an op, built or not (the runtime says when a build
# ran: calls.Call._note_builds). Hidden so real output stands out. (The ranks' FutureWarnings
# for collectives DeepSpeed calls by their old names are filtered on the ranks: on_rank.py.)
DEEPSPEED_NOISE = re.compile(
    r"cannot find -laio|collect2: error: ld returned|\[WARNING\].*untested optimizer"
    r"|^(begin bf16_optimizer|end bf16_ optimizer|(before|after) initializing group \d+)$"
    r"|^MA [\d.]+ GB +Max_MA|^CPU Virtual Memory: +used =|^DeepSpeed \S+ built successfully$"
)


class _Line:
    """A displayed line of text that can be replaced in place (a live progress bar)."""

    def __init__(self, text: str):
        self.text = text

    def __repr__(self) -> str:
        return self.text


def in_notebook() -> bool:
    """True inside a Jupyter kernel, where a display can be updated in place."""
    try:
        from IPython import get_ipython
    except ImportError:
        return False
    ip = get_ipython()
    return ip is not None and getattr(ip, "kernel", None) is not None


def _last_segment(text: str) -> str:
    """What a terminal shows for a line rewritten with carriage returns: its last non-empty part."""
    return next((s for s in reversed(text.split("\r")) if s.strip()), "")


class RankOutput:
    """Streams the output of one call on the ranks: :meth:`pump` often, :meth:`close` once."""

    def __init__(self, ranks: list[int], noise, limit: int = OUTPUT_LIMIT):
        self.ranks, self.noise, self.limit = ranks, noise, limit
        self.live = in_notebook()
        self.read: dict[tuple[int, str], int] = {}  # complete lines consumed, per (rank, stream)
        self.partial: dict[tuple[int, str], str] = {}  # the unfinished last line
        self.bars: dict[tuple[int, str], list] = {}  # [display handle, text, last update time]
        self.shown = dict.fromkeys(ranks, 0)
        self.dropped = dict.fromkeys(ranks, 0)
        self.divert = None  # a file that takes the lines instead of the cell (a C++ build's log)
        self.held: list | None = None  # lines kept back until they go to a log or to the cell

    def pump(self, futures: list) -> None:
        for r, f in zip(self.ranks, futures, strict=True):
            for stream in ("stdout", "stderr"):
                self._feed((r, stream), getattr(f, stream, "") or "")

    def close(self, futures: list) -> None:
        self.pump(futures)
        for key, rest in self.partial.items():
            if key in self.bars:
                self._end_bar(key, _last_segment(rest))
            elif rest.strip():
                self._emit(key, rest)
        self.partial.clear()
        for r, n in self.dropped.items():
            if n:
                print(
                    f"[rank {r}] ... {n:,} more characters not shown: a cell shows at most "
                    f"{self.limit:,} characters per rank (gas_lab.runtime.streaming.OUTPUT_LIMIT)",
                    file=sys.stderr,
                )

    def _feed(self, key, text: str) -> None:
        """``text`` is everything the rank wrote to one stream so far. Complete lines never
        change; ipyparallel collapses the last, unfinished line when a carriage return rewrites
        it, so that line is compared with what it was, not appended to."""
        done, cut = self.read.get(key, 0), text.rfind("\n") + 1
        if cut > done:
            for line in text[done:cut].split("\n")[:-1]:
                line = _last_segment(line) if "\r" in line else line
                if key in self.bars:
                    self._end_bar(key, line)
                else:
                    self._emit(key, line)
            self.read[key] = done = cut
            self.partial[key] = ""
        rest, before = text[done:], self.partial.get(key, "")
        if rest != before:
            if key in self.bars or "\r" in rest or not rest.startswith(before):
                self._show_bar(key, _last_segment(rest))  # a line rewritten in place
            self.partial[key] = rest

    def hold(self) -> None:
        """Keep the lines back (while a build lock is young: a build's lines go to its log, a
        load's to the cell) until :meth:`release`."""
        self.held = []

    def release(self, log=None) -> None:
        """The lines kept back: into ``log``, or into the cell as they would have gone."""
        held, self.held = self.held or [], None
        for key, line in held:
            if log is not None:
                log.write(f"[rank {key[0]}] {line}\n")
            else:
                self._emit(key, line)

    def _emit(self, key, line: str) -> None:
        r, stream = key
        if self.held is not None:
            self.held.append((key, line))
            return
        if self.divert is not None:
            self.divert.write(f"[rank {r}] {line}\n")
            return
        if self.noise.search(line):
            return
        if self.shown[r] + len(line) > self.limit:
            self.dropped[r] += len(line) + 1
            return
        self.shown[r] += len(line) + 1
        print(f"[rank {r}] {line}", file=sys.stdout if stream == "stdout" else sys.stderr)

    def _show_bar(self, key, text: str) -> None:
        text = f"[rank {key[0]}] {text.strip()}"
        bar = self.bars.setdefault(key, [None, text, 0.0])
        bar[1] = text
        if not self.live or time.monotonic() - bar[2] < BAR_REFRESH:
            return  # outside a notebook the bar is printed once, when it is finished
        from IPython.display import display

        sys.stdout.flush()
        sys.stderr.flush()  # the bar goes below what was printed before it
        if bar[0] is None:
            bar[0] = display(_Line(text), display_id=True)
        else:
            bar[0].update(_Line(text))
        bar[2] = time.monotonic()

    def _end_bar(self, key, final: str) -> None:
        handle, text, _ = self.bars.pop(key)
        text = f"[rank {key[0]}] {final.strip()}" if final else text
        if handle is not None:
            handle.update(_Line(text))
        else:
            self._emit(key, text.split("] ", 1)[1])
