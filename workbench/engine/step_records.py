"""What every engine step leaves behind: a :class:`StepRecord` (batch, tokens, queue lengths,
scheduler vs model vs bookkeeping time), kept in ``LLMEngine.step_records``;
:func:`steps_frame` turns them into a pandas DataFrame (timelines, scheduler benchmarks)."""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass
class StepRecord:
    step: int
    start: float                 # clock at the start of the step
    schedule_s: float            # time in Scheduler.schedule (pure Python)
    model_s: float               # swaps + forward + sampling (waits for the device)
    post_s: float                # detokenization, stop checks, bookkeeping after sampling
    num_seqs: int                # sequences computed this step
    prefill_tokens: int
    decode_tokens: int
    running: int                 # after the step
    waiting: int
    swapped: int
    kv_used_blocks: int
    admitted: int = 0
    preempted: int = 0
    swapped_out: int = 0
    swapped_in: int = 0
    rejected: int = 0
    finished: int = 0
    request_ids: tuple = ()      # the requests computed this step, in batch order
    request_tokens: tuple = ()   # tokens each of them computed (same order): a prefill chunk's length, 1 when
                                 # decoding (more only when a preempted request recomputes past its prompt)
    request_prefill: tuple = ()  # per request: True for a prefill chunk (it starts inside the prompt, as
                                 # prefill_tokens counts it), False for decode; the two sum to those columns

    def as_dict(self) -> dict:
        """The record as plain values (JSON, a DataFrame row)."""
        return asdict(self)


def step_record(out, scheduler, kv_used_blocks: int, t0: float, t1: float, t2: float, t3: float,
                finished: int) -> StepRecord:
    """The record of one step: ``out`` the scheduler's output, ``t0``..``t3`` the clock at the
    start, after scheduling, after sampling and at the end; queue lengths are read after it."""
    return StepRecord(
        out.step, t0, t1 - t0, t2 - t1, t3 - t2, len(out.scheduled), out.num_prefill_tokens,
        out.num_decode_tokens, len(scheduler.running), len(scheduler.waiting), len(scheduler.swapped),
        kv_used_blocks, len(out.admitted), len(out.preempted), len(out.swapped_out),
        len(out.swapped_in), len(out.rejected), finished,
        tuple(s.seq.request_id for s in out.scheduled), tuple(s.num_tokens for s in out.scheduled),
        tuple(s.start < s.seq.prompt_len for s in out.scheduled))


def steps_frame(records):
    """A pandas DataFrame, one row per :class:`StepRecord`."""
    import pandas as pd

    return pd.DataFrame([r.as_dict() for r in records])
