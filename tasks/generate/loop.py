"""The generate stage for one dataset: prompts -> the serving engine (tasks/serving/) -> checkpointed responses.

Exactly once: a prompt is skipped when its id is in the dataset's responses or among the rejects
that still stand (tasks.responses.rejects: a prompt rejected as too long is checked again on every run); a
response is recorded once, when it arrives complete and checked. Requests aborted (by the budget
gate or by the server) are not recorded, so resume sends them again. One the server aborts on its
own is sent again in the same run up to `max_requeues` times, then becomes a reject with cause
`aborted`, checked again on the next run: no prompt ends neither recorded nor named.

Requests go through a pool of servers (tasks.serving.pool): one server, several, or a router;
a server that fails is left for the others and its requests are sent again there.

Stops at once, keeping every part already written, when a checkpoint cannot be written (disk
full: `WriteFailed`), when a server refuses the run itself (401/403/404: `ServerRefused`,
nothing is rejected) or no server is reachable for the outage window (`ServerOutage`):
in-flight requests are aborted at their server and nothing new is sent.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections import deque
from pathlib import Path
from typing import Any

from models.common.file_errors import WriteFailed
from models.common.jobs import GenerateJob
from settings.layout import RunLayout
from tasks.datasets import PromptRow, Reject
from tasks.generate.budget import TokenBudget
from tasks.generate.conversations import Conversation, answer_text
from tasks.generate.prompts import chat_prompt_ids, prompt_sampling_seed
from tasks.generate.report import GenerateReport, Progress, ProgressHook
from tasks.generate.work import plan_work
from tasks.responses.checkpoints import ResponseWriter, done_ids, is_whole, quarantine_advice, summarize
from tasks.responses.parquet_io import DamagedPart
from tasks.responses.rejects import reject_counts, settle_generate_rejects, write_rejects
from tasks.serving.client import Completion
from tasks.serving.errors import BadRequest, ServerOutage
from tasks.serving.pool import ServerPool
from tasks.serving.pooled_server import Lease

log = logging.getLogger("eagle3.generate")


async def generate_dataset(
    prompts: list[PromptRow],
    *,
    pool: ServerPool,
    tokenizer: Any,
    layout: RunLayout,
    source: Path,
    settings: GenerateJob,
    vocab_size: int | None,
    on_progress: ProgressHook | None = None,
    logger: logging.Logger | logging.LoggerAdapter = log,
) -> GenerateReport:
    """Generate responses for the prompts not yet done, within the budget; resumable at any point.

    Writes the dataset's responses and rejects in `layout` (`settings.dataset` names it). `pool` may be shared by
    several datasets: its per-server limits hold over all of them. `vocab_size` checks every reply's ids against the
    target's vocabulary; None (a bench's or a test's ids-only tokenizer) checks nothing.
    """
    started = time.monotonic()
    responses_dir, rejects_dir = layout.responses(settings.dataset), layout.rejects(settings.dataset)
    if settings.max_prompts is not None:
        prompts = prompts[: settings.max_prompts]
    try:  # every part is read before anything is sent: a damaged one stops the run here
        before = summarize(responses_dir)
        responded = done_ids(responses_dir)
        standing = settle_generate_rejects(rejects_dir, responded, retry_refused=settings.retry_rejects)
    except DamagedPart as exc:
        raise exc.with_advice(quarantine_advice(exc.path, responses_dir)) from None
    work = plan_work(prompts, settings, responses_dir, responded, standing, tokenizer)
    queue, total = work.queue, work.total
    budget = TokenBudget(
        settings.token_budget, int(settings.sampling_params.get("max_new_tokens", 128)), spent=before.completion_tokens
    )
    budget.seed(before.lengths)
    logger.info("%s: %s", settings.dataset, work.describe(len(prompts), before))
    run = _Run(settings, pool, tokenizer, budget, source, rejects_dir, logger, vocab_size)
    run.conversations, run.ended = work.conversations, work.ended
    if work.holes:
        logger.warning(
            "%s: %d conversation(s) not continued: a turn is missing while later turns are on disk (a part moved "
            "aside?): %s",
            settings.dataset,
            len(work.holes),
            ", ".join(work.holes[:10]),
        )
    for row in work.empty:
        run.reject(
            row, "turns: all regenerates a conversation up to its first tool call: no user turn before it", "bad_row"
        )
    run.writer = ResponseWriter(
        responses_dir,
        flush_every=settings.flush_every,
        flush_interval_s=settings.flush_interval_s,
        compact_min_parts=settings.compact_min_parts,
    )
    run.done_before = before.rows
    run.total = total - work.rejected_before

    if queue and not budget.exhausted:
        await pool.start()
        timer = asyncio.create_task(run.flush_on_time())
        reporter = asyncio.create_task(run.report_every(on_progress))
        try:
            await run.drain(queue)
        finally:
            timer.cancel()
            reporter.cancel()
            await run.close()
        if run.failure is not None:
            raise run.failure
        if on_progress is not None:
            await on_progress(run.progress())
    elif run.rejects:  # turns: all: rows with nothing to regenerate, named
        await run.close()

    after = summarize(responses_dir)
    wall = time.monotonic() - started
    return GenerateReport(
        dataset=settings.dataset,
        status="budget reached" if budget.exhausted else "complete",
        responses=after.rows,
        new_responses=after.rows - before.rows,
        rejects=work.rejected_before + len(run.rejects),
        new_rejects=len(run.rejects),
        completion_tokens=after.completion_tokens,
        wasted_tokens=budget.wasted,
        aborted=run.aborted,
        wall_s=wall,
        tokens_per_s=(after.completion_tokens - before.completion_tokens) / wall if wall > 0 else 0.0,
        finish_reasons=after.finish_reasons,
        reject_causes=reject_counts(rejects_dir),
        conversations=after.conversations if settings.turns == "all" else None,
        ended_conversations=run.ended,
    )


class _Run:
    """State of one generate_dataset call: in-flight requests, writer, rejects, counters."""

    def __init__(self, settings, pool, tokenizer, budget, source, rejects_dir, logger, vocab_size) -> None:
        self.settings = settings
        self.rejects_dir = Path(rejects_dir)
        self.log = logger
        self.pool: ServerPool = pool
        self.vocab_size: int | None = vocab_size
        self.tokenizer = tokenizer
        self.budget: TokenBudget = budget
        self.source = source
        self.writer: ResponseWriter
        self.in_flight: dict[str, asyncio.Task] = {}
        self.closed_by_budget: set[str] = (
            set()
        )  # keys of requests stopped by closing their connection (no /abort_request)
        self.rejects: list[Reject] = []
        self.requeues: dict[str, int] = {}
        self.stopping = False  # budget reached: abort what runs, send nothing new
        self.failure: BaseException | None = None
        self.cancelled: list[str] = []  # keys of requests cancelled by a failure: aborted at the server in close()
        self.write_broken = False  # a checkpoint write failed: stop writing, keep what is on disk
        self.wake = asyncio.Event()  # set when a request ends or the run fails: the send loop looks again
        # Clear while a checkpoint is being written: nothing new is sent until it is known to be on
        # disk, so a failed write loses at most the flushed window plus what was in flight.
        self.written = asyncio.Event()
        self.written.set()
        self.aborted = 0
        self.recorded = 0
        self.conversations: dict[str, Conversation] = {}  # turns: all: by the response id of the turn in the queue
        self.ended = 0  # turns: all: conversations ended before their last user turn
        self.done_before = 0
        self.total = 0
        self.window: deque[tuple[float, int, int]] = deque()  # (time, spent, done) samples

    async def drain(self, queue: deque[PromptRow]) -> None:
        """Send every queued prompt that the budget admits; return when nothing is left in flight."""
        wake = self.wake
        cap = self.settings.max_in_flight
        while self.failure is None and not self.stopping:
            if queue and self.budget.can_admit() and (cap is None or len(self.in_flight) < cap):
                row = queue.popleft()
                ids = chat_prompt_ids(self.tokenizer, row.messages, row.tools)
                limit = self.pool.input_limit()
                if limit is not None and len(ids) >= limit:
                    self.reject(
                        row,
                        f"prompt is {len(ids)} tokens; "
                        f"the server accepts at most {limit - 1} (max_req_input_len {limit})",
                        "too_long",
                    )
                    continue
                await self.written.wait()
                try:  # may wait for other datasets or for a server to come back: the budget may have moved meanwhile
                    lease = await self.pool.reserve(len(ids))
                except ServerOutage as exc:
                    queue.appendleft(row)
                    self.fail(exc)
                    break
                if self.stopping or self.failure is not None or not self.budget.can_admit():
                    self.pool.release(lease)
                    queue.appendleft(row)
                    if self.stopping or self.failure is not None:
                        break
                    wake.clear()
                    await wake.wait()
                    continue
                self.budget.admit()
                key = f"{self.settings.dataset}:{row.id}"  # names the request; each send gets its own rid (server_pool)
                task = asyncio.create_task(self.one(row, ids, key, lease, queue, wake))

                def release(_: asyncio.Task, lease: Lease = lease) -> None:  # this lease, bound now
                    self.pool.release(lease)

                task.add_done_callback(release)  # also if cancelled before it ran
                self.in_flight[key] = task
                continue
            if not self.in_flight:
                break
            wake.clear()
            await wake.wait()  # a request finished: the budget or the queue may have changed
        if self.in_flight:
            await asyncio.gather(*self.in_flight.values(), return_exceptions=True)

    def request_params(self, row: PromptRow) -> dict[str, Any]:
        """The sampling_params of `row`'s request: the dataset's, plus its own sampling_seed when
        sampling.seed is set."""
        params = self.settings.sampling_params
        if self.settings.sampling_seed is None:
            return params
        return {
            **params,
            "sampling_seed": prompt_sampling_seed(self.settings.sampling_seed, self.settings.dataset, row.id),
        }

    async def one(
        self, row: PromptRow, ids: list[int], key: str, lease: Lease, queue: deque[PromptRow], wake: asyncio.Event
    ) -> None:
        sent = time.monotonic()
        try:
            if self.stopping:  # the budget was reached after this request was admitted, before it was sent:
                self.budget.discard()  # abort_in_flight found it at no server, so it must not be sent now
                return
            done = await self.pool.generate(lease, ids, self.request_params(row), key, vocab_size=self.vocab_size)
        except BadRequest as exc:
            self.budget.discard()
            self.reject(
                row,
                f"server refused the prompt (HTTP {exc.status}): {exc.message}",
                "too_long" if exc.too_long else "refused",
            )
            return
        except ServerOutage as exc:
            self.budget.discard()
            queue.appendleft(row)
            self.fail(exc)
            return
        except asyncio.CancelledError:
            self.budget.discard()
            if key in self.closed_by_budget:  # stopped at the budget by closing its connection: an abort
                self.aborted += 1
                return
            raise
        except BaseException as exc:  # a bug or an unexpected answer: stop cleanly, keep what is done
            self.budget.discard()
            self.fail(exc)
            return
        finally:
            self.pool.release(lease)
            self.in_flight.pop(key, None)
            wake.set()
        if done.finish_reason == "abort":
            self.budget.discard(done.completion_tokens)
            self.aborted += 1
            if not self.stopping:  # not ours: the server aborted it (a restart, a timeout of its own, an operator)
                self.server_aborted(row, done, queue)
            return
        self.record(row, ids, done, time.monotonic() - sent)
        conv = self.conversations.pop(row.id, None)
        if conv is not None:
            self.continue_conversation(conv, done, queue)
        if self.budget.exhausted and not self.stopping:
            self.stopping = True
            await self.abort_in_flight()
        await self.flush(due_only=True)

    def server_aborted(self, row: PromptRow, done: Completion, queue: deque[PromptRow]) -> None:
        """Send a prompt the server aborted again later, at most max_requeues times; then it is a named reject.

        The reject's cause, `aborted`, is checked again on the next run (tasks.responses.rejects): the prompt
        is never dropped without a trace.
        """
        n = self.requeues.get(row.id, 0)
        message = done.finish_detail.get("message") or "no message"
        if n < self.settings.max_requeues:
            self.requeues[row.id] = n + 1
            self.log.info(
                "%s: prompt %s aborted by the server (%s): sent again later (%d of %d)",
                self.settings.dataset,
                row.id,
                message,
                n + 1,
                self.settings.max_requeues,
            )
            queue.append(row)
            return
        self.reject(
            row,
            f"the server aborted it {n + 1} times (generate.max_requeues {self.settings.max_requeues}); "
            f"last: {message}. Tried again on the next run",
            "aborted",
        )

    async def flush(self, *, due_only: bool) -> None:
        """Write the buffered responses (when due); a failed write stops the whole run at once."""
        if self.write_broken or (due_only and not self.writer.due()):
            return
        self.written.clear()
        try:
            await self.writer.flush()
        except OSError as exc:
            self.write_broken = True  # nothing more is written: the parts on disk stay as they are
            self.fail(self.write_failed(self.writer.directory, exc))
        except Exception as exc:  # not the disk: still stop cleanly rather than lose an exception in a task
            self.write_broken = True
            self.fail(exc)
        finally:
            self.written.set()

    def write_failed(self, path: Path, exc: OSError) -> WriteFailed:
        lost = self.writer.pending + len(self.in_flight)
        return WriteFailed(
            path,
            exc,
            kept=f"{self.done_before + self.recorded - self.writer.pending:,} responses of {self.settings.dataset} in "
            f"{self.writer.directory} (every part written is whole); {lost:,} answered or in-flight prompts "
            "could not be kept and are generated again on resume",
            resume="free space there (or move run_dir to a bigger disk), "
            "then run the same command: it resumes exactly once",
        )

    async def flush_on_time(self) -> None:
        """Flush on time even when no response arrives to trigger it (run as a background task)."""
        while self.failure is None:
            await asyncio.sleep(min(1.0, self.settings.flush_interval_s / 4))
            await self.flush(due_only=True)

    def record(self, row: PromptRow, ids: list[int], done: Completion, latency: float) -> None:
        self.writer.add(
            {
                "id": row.id,
                "prompt_ids": ids,
                "output_ids": done.output_ids,
                "prompt_tokens": done.prompt_tokens,
                "completion_tokens": done.completion_tokens,
                "finish_reason": done.finish_reason,
                "text": self.text(done),
                "latency": latency,
                "cached_tokens": done.cached_tokens,
                "reasoning_tokens": done.reasoning_tokens,
                "finished_at": time.time(),
            }
        )
        self.budget.finish(done.completion_tokens)
        self.recorded += 1

    def text(self, done: Completion) -> str:
        """The response's text: the server's, else (a server started with --skip-tokenizer-init sends none, as the
        real SGLang on CPU is) the target's tokenizer's decode of output_ids, special tokens kept as requested."""
        if done.text or not done.output_ids or not hasattr(self.tokenizer, "decode"):
            return done.text
        return self.tokenizer.decode(done.output_ids, skip_special_tokens=False)

    def continue_conversation(self, conv: Conversation, done: Completion, queue: deque[PromptRow]) -> None:
        """turns: all: queue the conversation's next turn (first, so conversations finish in order); a turn cut by
        the length limit ends the conversation."""
        stop_ids = self.settings.sampling_params.get("stop_token_ids") or []
        if not is_whole(done.output_ids, done.finish_reason, stop_ids):
            if conv.next_turn + 1 < len(conv.users):
                self.ended += 1
            return
        conv.answers.append(answer_text(self.tokenizer, done.output_ids, stop_ids))
        if not conv.finished:
            row = conv.prompt()
            self.conversations[row.id] = conv
            queue.appendleft(row)

    def reject(self, row: PromptRow, reason: str, cause: str) -> None:
        if self.conversations.pop(row.id, None) is not None:  # turns: all: a rejected turn ends its conversation
            self.ended += 1
        self.log.warning("%s: prompt %s rejected (%s): %s", self.settings.dataset, row.id, cause, reason)
        raw = json.dumps(row.messages, ensure_ascii=False)
        self.rejects.append(Reject(path=self.source, row=0, id=row.id, reason=reason, raw=raw, cause=cause))

    def fail(self, exc: BaseException) -> None:
        """Stop the run: the first failure is the one raised;
        in-flight requests are cancelled (and aborted in close)."""
        if self.failure is None:
            self.failure = exc
            self.wake.set()
            self.log.error("%s: stopping: %s", self.settings.dataset, exc)
            current = asyncio.current_task()
            for key, task in self.in_flight.items():
                if task is not current:
                    self.cancelled.append(key)
                    task.cancel()

    async def abort_in_flight(self) -> None:
        """Budget reached: stop every running request of this dataset (they come back as aborts).

        Behind a router, which has no /abort_request, a request is stopped by closing its connection
        (SGLang and vLLM abort it); its partial tokens are then unknown, so they are not counted as waste.
        vLLM has no abort at all for these requests: there every request is stopped so.
        """
        keys = list(self.in_flight)
        if keys:
            self.log.info("%s: budget reached, aborting %d in-flight request(s)", self.settings.dataset, len(keys))
            aborted = await asyncio.gather(*(self.pool.abort(key) for key in keys))
            current = asyncio.current_task()
            for key, ok in zip(keys, aborted):
                task = self.in_flight.get(key)
                if not ok and task is not None and task is not current:
                    self.closed_by_budget.add(key)
                    task.cancel()

    async def close(self) -> None:
        """Flush what arrived and record the rejects, also when the run failed or was cancelled.

        Never raises over the first failure: a write that fails here becomes `failure` if there
        was none (the caller raises it).
        """
        keys = self.cancelled + list(self.in_flight)
        if self.in_flight:  # cancelled (Ctrl-C, Prefect cancellation): free the GPUs, then forget them
            tasks = list(self.in_flight.values())
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        if keys:  # a closed connection makes the engine abort too; the explicit abort does not depend on it
            await asyncio.wait_for(asyncio.gather(*(self.pool.abort(key) for key in keys)), 10)
        await self.flush(due_only=False)
        if self.rejects:
            try:
                await asyncio.to_thread(write_rejects, self.rejects, self.rejects_dir, "generate")
            except OSError as exc:
                if self.failure is None:
                    self.failure = WriteFailed(
                        self.rejects_dir,
                        exc,
                        kept=f"every response part of {self.settings.dataset}",
                        resume=f"free space, then run again: the {len(self.rejects)} prompts "
                        "rejected in this run are checked again",
                    )

    def progress(self) -> Progress:
        now = time.monotonic()
        done = self.done_before + self.recorded
        self.window.append((now, self.budget.spent, done))
        while len(self.window) > 2 and now - self.window[1][0] >= self.settings.throughput_window_s:
            self.window.popleft()
        t0, spent0, done0 = self.window[0]
        dt = now - t0
        tok_s = (self.budget.spent - spent0) / dt if dt > 0 else 0.0
        done_s = (done - done0) / dt if dt > 0 else 0.0
        # ETA from recent throughput: tokens left in the budget, or prompts left, whichever ends first
        etas = []
        if self.budget.limit is not None and tok_s > 0:
            etas.append(max(0, self.budget.limit - self.budget.spent) / tok_s)
        if done_s > 0:
            etas.append(max(0, self.total - done - len(self.rejects)) / done_s)
        eta = min(etas) if etas else None
        return Progress(
            dataset=self.settings.dataset,
            done=done,
            total=self.total,
            rejects=len(self.rejects),
            completion_tokens=self.budget.spent,
            mean_length=self.budget.spent / done if done else 0.0,
            tokens_per_s=tok_s,
            budget=self.budget.limit,
            eta_s=0.0 if self.budget.exhausted else eta,
            in_flight=len(self.in_flight),
            servers=self.pool.line(),
        )

    async def report_every(self, on_progress: ProgressHook | None) -> None:
        self.progress()  # first window sample at the start
        while True:
            await asyncio.sleep(self.settings.log_interval_s)
            snapshot = self.progress()
            self.log.info(snapshot.line())
            if on_progress is not None:
                await on_progress(snapshot)
