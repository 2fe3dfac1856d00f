"""Locust user for dflash-serve: streaming OpenAI chat completions and completions, timed from the SSE stream.

    locust -f loadtest/chat.py --host http://127.0.0.1:30000                       # web UI on :8089
    locust -f loadtest/chat.py --host http://127.0.0.1:30000 --headless -u 8 -r 8 -t 60s --csv out/run

Each dataset line is one request: a chat line streams /v1/chat/completions, a {"prompt": ...} line streams
/v1/completions (raw text, no chat template); a line's own "temperature" overrides --temperature (mixed traffic:
loadtest/prompts/mixed.jsonl). Each request streams (`stream_options.include_usage`) and reports, besides the
request itself, custom "METRIC" entries in Locust's stats, CSV and web UI (response time column = the value):
  ttft           ms to the first non-empty content delta
  itl            ms between consecutive content chunks (one entry per gap; a speculative step may emit
                 several tokens in one chunk, so this is per chunk -- see tpot for per token)
  tpot           ms per output token after the first: (e2e - ttft) / (output_tokens - 1)
  e2e            ms from sending the request to `data: [DONE]`
  output_tokens  completion tokens from the final usage chunk (the value is a count, not ms)
  client_tokenize  with --client-tokenizer: ms the client spent re-tokenizing the answer so far, per chunk
A request fails on a non-200 status, malformed SSE, a missing `[DONE]`, a missing usage chunk or empty output.
The run exits non-zero when failures / requests exceeds --max-failure-ratio.

Options (besides Locust's own -u, -r, -t, --headless, --csv, ...; `locust --help` cannot list them because it
answers before loading this file -- the web UI shows them): --model (default: ask /v1/models), --max-tokens 128,
--temperature 0 (a dataset line's "temperature" wins), --ignore-eos, --think-time 0 (closed loop), --dataset
FILE.jsonl (default: the bundled loadtest/prompts/mix.jsonl), --prompt-order random, --client-tokenizer DIR
(a CPU-heavy client: re-tokenize the answer on every chunk in this process), --max-failure-ratio 0.01,
--api-key (or LOCUST_API_KEY), --requests N (stop after N requests), --summary-file FILE.json, --record-file
FILE.jsonl (one line per completed request), --rate R with --arrival poisson|constant (open loop: requests
arrive at R/s whatever the answers do; -u caps the requests in flight), --warmup-requests N (open loop: the first
N arrivals load the server but are not measured), --slo-ttft MS / --slo-tpot MS (goodput). See
loadtest/README.md.

Locust always runs in its own process: it monkey-patches everything with gevent, which breaks SGLang.
"""
from __future__ import annotations

import json
import logging
import random
import sys
import time
from pathlib import Path

# Locust imports this file by path; make `loadtest.*` importable from any working directory.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import gevent  # noqa: E402
import requests  # noqa: E402
from locust import HttpUser, events, task  # noqa: E402
from locust.exception import StopUser  # noqa: E402

from loadtest.arrivals import Schedule  # noqa: E402
from loadtest.client_work import ClientTokenizerError, Retokenizer, load_tokenizer  # noqa: E402
from loadtest.dataset import BUNDLED, DatasetError, Request, load_requests  # noqa: E402
from loadtest.sse import ChatStreamParser, StreamError, StreamTimings  # noqa: E402
from loadtest.summary import RunRecorder  # noqa: E402

METRIC = "METRIC"
# After a failure a closed-loop user would hammer a dead server with thousands of refused connections a
# second, flooding the stats and burning the CPU the server needs; pause briefly instead.
FAILURE_BACKOFF_S = 0.5

log = logging.getLogger("loadtest.chat")
PROMPTS: list[Request] = []
RECORDER = RunRecorder()
CLIENT: dict[str, object] = {}    # "tokenizer": the --client-tokenizer's; "record": the --record-file, open
_MODELS: dict[str, str] = {}      # host -> model listed by /v1/models
_BUDGET = {"sent": 0, "done": 0}  # requests of this test, for --requests


@events.init_command_line_parser.add_listener
def _options(parser) -> None:
    # on the parser itself: Locust's web-UI extras (is_secret, include_in_web_ui) do not exist on groups
    parser.add_argument("--model", default="", help="model name to request (default: the first of /v1/models)")
    parser.add_argument("--max-tokens", type=int, default=128, help="max_tokens per request (default 128)")
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="sampling temperature of lines without their own 'temperature' (default 0: greedy)")
    parser.add_argument("--ignore-eos", action="store_true", default=False,
                        help="generate exactly --max-tokens tokens per request (SGLang's ignore_eos)")
    parser.add_argument("--think-time", type=float, default=0.0,
                        help="seconds a user waits between its requests (default 0: closed loop)")
    parser.add_argument("--dataset", default="",
                        help=f"JSONL, one request a line: chat (OpenAI {{'messages': ...}} or ShareGPT "
                             f"{{'conversations': ...}}, sent to /v1/chat/completions) or completion ({{'prompt': "
                             f"'...'}}, sent to /v1/completions), each with an optional 'temperature' that overrides "
                             f"--temperature (default: {BUNDLED.relative_to(BUNDLED.parents[2])})")
    parser.add_argument("--prompt-order", choices=("random", "sequence"), default="random",
                        help="random: each request draws a prompt; sequence: the k-th request sent takes the k-th "
                             "prompt of one fixed shuffle (seed 0), so runs against different servers send the same "
                             "prompts in the same order (default random)")
    parser.add_argument("--client-tokenizer", default="", metavar="DIR",
                        help="a CPU-heavy client: on every streamed chunk, re-tokenize the text received so far with "
                             "this Hugging Face tokenizer (e.g. models/tiny-code/target) in the Locust process, as "
                             "third-party benchmark clients do; its cost is the client_tokenize metric "
                             "(default: off)")
    parser.add_argument("--max-failure-ratio", type=float, default=0.01,
                        help="exit non-zero when failed/all requests exceeds this (default 0.01)")
    parser.add_argument("--api-key", default="", is_secret=True, env_var="LOCUST_API_KEY",
                        help="bearer token (env LOCUST_API_KEY)")
    parser.add_argument("--requests", type=int, default=0,
                        help="stop after this many requests, failed ones included (default 0: no limit)")
    parser.add_argument("--rate", type=float, default=0.0,
                        help="open loop: requests arrive at this many per second whatever the answers do; -u caps "
                             "the requests in flight (an arrival with every user busy waits for one) (default 0: "
                             "closed loop)")
    parser.add_argument("--arrival", choices=("poisson", "constant"), default="poisson",
                        help="open loop: exponential gaps (seed 0: every run draws the same times) or equal gaps "
                             "(default poisson)")
    parser.add_argument("--warmup-requests", type=int, default=0,
                        help="open loop: the first N arrivals are sent but not measured, on top of --requests "
                             "(default 0)")
    parser.add_argument("--slo-ttft", type=float, default=0.0,
                        help="goodput: a request meets its SLO with TTFT at most this many ms (default 0: no limit)")
    parser.add_argument("--slo-tpot", type=float, default=0.0,
                        help="goodput: ... and TPOT at most this many ms (default 0: no limit)")
    parser.add_argument("--summary-file", default="", include_in_web_ui=False,
                        help="write exact percentiles and steady-state throughput as JSON here on exit")
    parser.add_argument("--record-file", default="", include_in_web_ui=False,
                        help="append one JSON line per completed request here: its dataset line, endpoint, "
                             "temperature, timings, output tokens and text (the file is emptied at start)")


@events.init.add_listener
def _init(environment, **_kw) -> None:
    opts = environment.parsed_options
    if opts is None:            # used as a library (locust.env.Environment) without a command line
        return
    problems = [msg for bad, msg in (
        (opts.max_tokens < 1, "--max-tokens must be >= 1"),
        (opts.temperature < 0, "--temperature must be >= 0"),
        (opts.think_time < 0, "--think-time must be >= 0 seconds"),
        (opts.requests < 0, "--requests must be >= 0"),
        (opts.rate < 0, "--rate must be >= 0 requests/s"),
        (opts.warmup_requests < 0, "--warmup-requests must be >= 0"),
        (opts.warmup_requests > 0 and not opts.rate, "--warmup-requests needs --rate (open loop)"),
        (opts.slo_ttft < 0 or opts.slo_tpot < 0, "--slo-ttft and --slo-tpot must be >= 0 ms"),
        (not 0 <= opts.max_failure_ratio <= 1, "--max-failure-ratio must be between 0 and 1"),
    ) if bad]
    if problems:
        _usage_error("; ".join(problems))
    try:
        PROMPTS[:] = load_requests(opts.dataset or None)
    except DatasetError as e:
        _usage_error(f"--dataset {e}")
    CLIENT.clear()
    if opts.client_tokenizer:
        try:
            CLIENT["tokenizer"] = load_tokenizer(opts.client_tokenizer)
        except ClientTokenizerError as e:
            _usage_error(f"--client-tokenizer {e}")
    if opts.record_file:
        Path(opts.record_file).parent.mkdir(parents=True, exist_ok=True)
        CLIENT["record"] = open(opts.record_file, "w", encoding="utf-8")  # noqa: SIM115 -- open for the run
    if opts.prompt_order == "sequence":  # a fixed shuffle: the file's order may group its categories
        random.Random(0).shuffle(PROMPTS)


def _usage_error(msg: str) -> None:
    # SystemExit, not an exception: Locust logs exceptions from event handlers and carries on
    print(f"loadtest/chat.py: error: {msg}", file=sys.stderr)
    sys.exit(2)


@events.test_start.add_listener
def _test_start(environment=None, **_kw) -> None:
    RECORDER.reset(time.perf_counter())
    _BUDGET.update(sent=0, done=0)
    opts = getattr(environment, "parsed_options", None)
    if opts is not None and opts.rate:
        SCHEDULE.reset(opts.rate, opts.arrival, opts.requests + opts.warmup_requests if opts.requests else 0)


SCHEDULE = Schedule()


@events.reset_stats.add_listener
def _reset_stats(**_kw) -> None:
    RECORDER.reset(time.perf_counter())


@events.test_stop.add_listener
def _test_stop(**_kw) -> None:
    RECORDER.stopped_at = time.perf_counter()


def report_metric(name: str, value: float, length: int = 0) -> None:
    """One sample of a custom metric as a Locust "request" (request_type METRIC), as fw-ai/benchmark does."""
    events.request.fire(request_type=METRIC, name=name, response_time=value, response_length=length,
                        exception=None, context=None)


class ChatUser(HttpUser):
    """One user in a closed loop: pick a prompt, stream the answer, repeat after --think-time. With --rate: a
    slot of the open loop (Schedule): take the next arrival, wait until it is due, stream it, repeat."""

    def wait_time(self) -> float:
        opts = self.environment.parsed_options
        return 0.0 if opts.rate else opts.think_time

    def on_start(self) -> None:
        opts = self.environment.parsed_options
        self.headers = {"Authorization": f"Bearer {opts.api_key}"} if opts.api_key else {}

    @task
    def chat(self) -> None:
        opts = self.environment.parsed_options
        if opts.rate:
            self._open_loop(opts)
            return
        limit = opts.requests
        if limit and _BUDGET["sent"] >= limit:
            raise StopUser()                  # the others finish the requests still running
        if not self._stream_one():
            time.sleep(FAILURE_BACKOFF_S)     # gevent-patched: yields to the other users

    def _open_loop(self, opts) -> None:
        slot = SCHEDULE.claim(time.perf_counter())
        if slot is None:
            raise StopUser()                  # every arrival is out; the others finish theirs
        k, wait = slot
        if wait > 0:
            time.sleep(wait)                  # gevent-patched: the other users go on
        warmup = k < opts.warmup_requests
        if not warmup:
            RECORDER.dispatch_delays_ms.append(max(0.0, -wait) * 1e3)
        # no failure back-off: arrivals keep their schedule whatever the server answers
        self._stream_one(index=k, measured=not warmup)

    def _model(self) -> str | None:
        opts = self.environment.parsed_options
        if opts.model:
            return opts.model
        if self.host in _MODELS:
            return _MODELS[self.host]
        with self.client.get("/v1/models", headers=self.headers, catch_response=True) as r:
            if r.status_code != 200:
                r.failure(_http_error(r) + " (--model skips this lookup)")
                return None
            try:
                ids = [m["id"] for m in r.json()["data"]]
            except (ValueError, KeyError, TypeError):
                r.failure(f"/v1/models is not an OpenAI model list: {r.text[:200]!r}; pass --model")
                return None
            if not ids:
                r.failure("/v1/models lists no model; pass --model")
                return None
            r.success()
        _MODELS[self.host] = ids[0]
        return ids[0]

    def _stream_one(self, index: int | None = None, measured: bool = True) -> bool:
        """One request: the `index`-th prompt (open loop; else the next in sequence, or a random one); not
        recorded when not `measured` (an open-loop warm-up arrival)."""
        opts = self.environment.parsed_options
        model = self._model()
        if model is None:
            if opts.rate:
                _BUDGET["sent"] += 1              # the arrival is spent: failed, and the run still ends
                self._done(opts)
            return False
        if index is None:
            index = _BUDGET["sent"]
        req = (PROMPTS[index % len(PROMPTS)] if opts.prompt_order == "sequence" or opts.rate
               else random.choice(PROMPTS))
        temperature = opts.temperature if req.temperature is None else req.temperature
        max_tokens = opts.max_tokens if req.max_tokens is None else req.max_tokens
        body = {"model": model, **req.payload(), "max_tokens": max_tokens, "temperature": temperature,
                "stream": True, "stream_options": {"include_usage": True}}
        if opts.ignore_eos:
            body["ignore_eos"] = True
        _BUDGET["sent"] += 1
        try:
            return self._send(req, body, measured)
        finally:
            self._done(opts)

    def _done(self, opts) -> None:
        """One request over (answered or failed): the last of --requests (and, open loop, the warm-up) ends the
        run."""
        _BUDGET["done"] += 1
        if opts.requests and _BUDGET["done"] == opts.requests + (opts.warmup_requests if opts.rate else 0):
            # from another greenlet: stopping the runner kills this one
            runner = self.environment.runner
            gevent.spawn(runner.quit if opts.headless else runner.stop)

    def _send(self, req: Request, body: dict, measured: bool = True) -> bool:
        work = Retokenizer(CLIENT["tokenizer"]) if "tokenizer" in CLIENT else None
        start = time.perf_counter()
        with self.client.post(req.endpoint, json=body, headers=self.headers, stream=True,
                              catch_response=True) as r:
            if r.status_code != 200:
                r.failure(_http_error(r))
                return False
            parser = ChatStreamParser(start, on_text=work.on_text if work else None)
            try:
                for line in r.iter_lines():
                    parser.feed(line, time.perf_counter())
                timings = parser.finish(time.perf_counter())
            except StreamError as e:
                r.failure(str(e))
                return False
            except requests.RequestException as e:   # connection dropped mid-stream
                r.failure(f"stream broken after {time.perf_counter() - start:.1f}s: {e}")
                return False
            # Locust timed the request up to its headers; the user waits for the whole answer
            r.request_meta["response_time"] = timings.e2e * 1e3
            r.request_meta["response_length"] = len(timings.text)
            r.success()
        client_ms = work.costs_ms if work else []
        if not measured:
            RECORDER.record_unmeasured(time.perf_counter(), timings)
            return True
        RECORDER.record(id(self), time.perf_counter(), timings, client_ms)
        if "record" in CLIENT:
            _write_record(req, body, timings, start, work)
        report_metric("ttft", timings.ttft * 1e3)
        for gap in timings.itl:
            report_metric("itl", gap * 1e3)
        if timings.tpot is not None:
            report_metric("tpot", timings.tpot * 1e3)
        report_metric("e2e", timings.e2e * 1e3)
        report_metric("output_tokens", timings.output_tokens)
        for ms in client_ms:
            report_metric("client_tokenize", ms)
        return True


def _write_record(req: Request, body: dict, timings: StreamTimings, start: float, work: Retokenizer | None) -> None:
    """One completed request as a JSON line: what a per-request comparison of servers joins on (the line)."""
    f = CLIENT["record"]
    started = RECORDER.started_at if RECORDER.started_at is not None else start
    row = {"line": req.line, "endpoint": req.endpoint, "temperature": body["temperature"],
           "sent_s": start - started, "ttft_ms": timings.ttft * 1e3, "e2e_ms": timings.e2e * 1e3,
           "tpot_ms": None if timings.tpot is None else timings.tpot * 1e3, "chunks": len(timings.itl) + 1,
           "output_tokens": timings.output_tokens, "text": timings.text}
    if work is not None:
        row |= {"client_tokenize_ms": sum(work.costs_ms), "client_tokens": work.tokens}
    f.write(json.dumps(row) + "\n")
    f.flush()


def _http_error(r) -> str:
    """Failure text; Locust prefixes it with the method and name, and groups identical texts."""
    if r.status_code == 0:          # Locust's stand-in response for a connection error
        return f"no response: {r.error}"
    try:
        detail = r.text[:300]
    except Exception:  # noqa: BLE001 -- a broken body must not hide the status
        detail = "<unreadable body>"
    return f"HTTP {r.status_code}: {detail}"


@events.quitting.add_listener
def _quitting(environment, **_kw) -> None:
    """Exit status from the failure ratio of real requests (METRIC entries are samples, not requests)."""
    opts = environment.parsed_options
    entries = [e for e in environment.stats.entries.values() if e.method != METRIC]
    n = sum(e.num_requests for e in entries)
    failed = sum(e.num_failures for e in entries)
    exceptions = len(environment.runner.exceptions) if environment.runner else 0
    end = RECORDER.stopped_at or time.perf_counter()
    if "record" in CLIENT:
        CLIENT.pop("record").close()
    if opts.summary_file:
        users = environment.runner.target_user_count if environment.runner else None
        summary = RECORDER.summary(end, n, failed, host=environment.host, model=opts.model or _MODELS.get(
            environment.host or ""), users=users, max_tokens=opts.max_tokens, temperature=opts.temperature,
            ignore_eos=opts.ignore_eos, think_time_s=opts.think_time, dataset=opts.dataset or str(BUNDLED),
            client_tokenizer=opts.client_tokenizer or None, rate=opts.rate or None,
            arrival=opts.arrival if opts.rate else None, warmup_requests=opts.warmup_requests,
            slo_ttft_ms=opts.slo_ttft or None, slo_tpot_ms=opts.slo_tpot or None)
        Path(opts.summary_file).parent.mkdir(parents=True, exist_ok=True)
        Path(opts.summary_file).write_text(json.dumps(summary, indent=2) + "\n")
    if n == 0:
        if opts.headless:
            log.error("no request completed: lengthen -t or lower --max-tokens (is the server at %s up?)",
                      environment.host)
            environment.process_exit_code = 1
        return                      # web UI closed without a test: Locust's default status
    ratio = failed / n
    verdict = "exceeds" if ratio > opts.max_failure_ratio else "within"
    log.log(logging.ERROR if verdict == "exceeds" else logging.INFO,
            "failure ratio %.2f%% (%d of %d requests) %s --max-failure-ratio %.2f%%",
            100 * ratio, failed, n, verdict, 100 * opts.max_failure_ratio)
    if ratio > opts.max_failure_ratio:
        environment.process_exit_code = opts.exit_code_on_error
    elif exceptions:
        log.error("%d exception(s) in the user code (see the exceptions table): a bug, not a load result",
                  exceptions)
        environment.process_exit_code = opts.exit_code_on_error
    else:
        environment.process_exit_code = 0
