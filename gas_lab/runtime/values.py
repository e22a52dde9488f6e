"""What a ``%%ranks`` cell's last expression shows: each rank's value, as Jupyter shows a cell's
``Out``, one per rank and labelled with it (lesson 00).

Each rank formats its value with its own IPython display formatter (on_rank.exec_on_rank), so
a value with a rich repr (an HTML table, a picture) arrives as the same mime bundle Jupyter
would show for it in the notebook itself, and is shown as such; a value whose only form is
text is one line, ``[rank 0] Out[7]: 42``, the way IPython prints ``Out[7]: 42``.
"""

from __future__ import annotations


def _label(rank: int, cell: str | None) -> str:
    if cell and cell.startswith("In["):
        return f"[rank {rank}] Out[{cell[3:-1]}]:"
    return f"[rank {rank}] Out:"


def show_values(ranks: list[int], bundles: list, cell: str | None) -> None:
    """Show the ``(data, metadata)`` each of ``ranks`` returned (None: no value to show)."""
    import sys

    from IPython.display import display

    shell = _shell()
    sys.stdout.flush()
    sys.stderr.flush()  # the values go below what the ranks printed
    for rank, bundle in zip(ranks, bundles, strict=True):
        if bundle is None:
            continue
        data, metadata = bundle
        label, text = _label(rank, cell), data.get("text/plain", "")
        # IPython starts a value of several lines on a line of its own, below the prompt.
        labelled = f"{label}\n{text}" if "\n" in text else f"{label} {text}"
        if shell is None:  # a plain script: the text, as print would show it
            print(labelled)
        elif set(data) <= {"text/plain"}:
            display({"text/plain": labelled}, raw=True)
        else:  # the label, then the rich value itself (its own text/plain stays its fallback)
            display({"text/plain": label}, raw=True)
            display(data, metadata=metadata, raw=True)


def _shell():
    try:
        from IPython import get_ipython
    except ImportError:
        return None
    return get_ipython()
