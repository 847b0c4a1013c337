"""The LLM agent: a `Proposer` that asks any OpenAI-compatible endpoint for one schedule change per round.

Each round: build the briefing (megasynth.search.briefing), call the chat-completions API with a JSON-schema response
format (falling back to plain text + a JSON extractor for servers without structured output), check the answer (JSON,
schema, strategy values, patch ids — by lowering and patching it), and feed every error back for a bounded number of
retries. Transport failures (timeouts, 429, 5xx, refused connections) are retried with a capped backoff. When the
round's attempts or the run's call budget are spent the proposer returns no proposals: it never raises into the search.

Every request and response is appended to `runs/<run>/agent.jsonl` (one whole JSON line each); token counts (and the
cost, when a price is given) go to `runs/<run>/agent_usage.json`, rewritten atomically after every call.
"""

from __future__ import annotations

import json
import os
import re
import time
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from megasynth.atomic import write_json_atomic
from megasynth.ir.errors import ScheduleError, json_path
from megasynth.ir.program import resolve
from megasynth.ir.schedule import Schedule
from megasynth.lowering.lower import lower
from megasynth.lowering.models import ModelSpec
from megasynth.lowering.strategy import Strategy
from megasynth.runs.rundir import screened_text
from megasynth.search.briefing import DEFAULT_BUDGET, Briefing, build_briefing, normalise_profile, patch_schema
from megasynth.search.proposers.base import Proposal, Result, SearchContext

ENV_KEYS = ("OPENAI_API_KEY", "OPENAI_BASE_URL")
MAX_REPLY_CHARS = 40_000  # a proposal is a few knobs and patches; anything longer is a runaway answer
MAX_ERROR_FEEDBACK = 600  # chars of an error message fed back to the model


def agent_configured(env: dict[str, str] | None = None) -> bool:
    """`auto` picks the agent when an endpoint is configured (OPENAI_API_KEY or OPENAI_BASE_URL set and non-empty)."""
    env = dict(os.environ) if env is None else env
    return any(env.get(k) for k in ENV_KEYS)


@dataclass
class LLMOptions:
    """How the agent talks to the endpoint. `None` model = $OPENAI_MODEL, else gpt-4o-mini."""

    model: str | None = None
    max_calls: int = 30  # API calls per run, retries included
    temperature: float = 0.7
    timeout_s: float = 120.0
    attempts: int = 3  # API calls per round before the round gives up
    budget_tokens: int = DEFAULT_BUDGET  # briefing size
    max_output_tokens: int = 2048
    max_patches: int = 64
    backoff_s: float = 2.0  # first wait after a 429/5xx/timeout; doubles, capped at backoff_max_s
    backoff_max_s: float = 30.0
    seq: int = 1024  # sequence length the profile and per-op bytes refer to
    base_url: str | None = None  # default $OPENAI_BASE_URL (the openai client's own default otherwise)
    api_key: str | None = None  # default $OPENAI_API_KEY ("not-needed" for local servers without one)
    price_in_per_mtok: float | None = None  # USD per million prompt tokens, for the cost line (optional)
    price_out_per_mtok: float | None = None

    def resolved_model(self) -> str:
        return self.model or os.environ.get("OPENAI_MODEL") or "gpt-4o-mini"

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None, **overrides: Any) -> LLMOptions:
        """Options from the environment (SYNTH_LLM_BRIEFING_TOKENS, SYNTH_LLM_PRICE_IN / _OUT in USD per million
        tokens), then `overrides` that are not None (the CLI's --llm-* flags)."""
        env = dict(os.environ) if env is None else env
        values: dict[str, Any] = {}
        for key, name, kind in (("SYNTH_LLM_BRIEFING_TOKENS", "budget_tokens", int),
                                ("SYNTH_LLM_PRICE_IN", "price_in_per_mtok", float),
                                ("SYNTH_LLM_PRICE_OUT", "price_out_per_mtok", float)):
            if env.get(key):
                try:
                    values[name] = kind(env[key])
                except ValueError:
                    raise ValueError(f"{key}={env[key]!r} is not a number") from None
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**values)


class ProposalError(ValueError):
    """The model's answer cannot be used; the message is fed back to it."""


# ----------------------------------------------------------------------------------------------------------------
# The answer's schema and parsing


def _strictify(schema: Any, defs: dict[str, Any], depth: int = 0) -> Any:
    """A JSON schema in OpenAI's strict subset: every property required (nullable = keep), no open objects.
    Raises ValueError when an open mapping has no known keys (then the caller falls back to a non-strict schema)."""
    if depth > 20:
        raise ValueError("schema too deep")
    if isinstance(schema, list):
        return [_strictify(s, defs, depth + 1) for s in schema]
    if not isinstance(schema, dict):
        return schema
    if "$ref" in schema:
        name = schema["$ref"].rsplit("/", 1)[-1]
        return _strictify(defs[name], defs, depth + 1)
    out: dict[str, Any] = {}
    for k, v in schema.items():
        if k in ("title", "default", "$defs", "propertyNames", "examples", "discriminator"):
            continue
        if k == "oneOf":
            out["anyOf"] = _strictify(v, defs, depth + 1)
        elif k in ("items", "anyOf", "allOf", "not"):
            out[k] = _strictify(v, defs, depth + 1)
        elif k == "properties":
            out[k] = {p: _nullable(_strictify(s, defs, depth + 1)) for p, s in v.items()}
        elif k == "additionalProperties":
            continue
        else:
            out[k] = v
    if schema.get("type") == "object" or "properties" in schema or "additionalProperties" in schema:
        extra = schema.get("additionalProperties")
        if isinstance(extra, dict):
            keys = (schema.get("propertyNames") or {}).get("enum")
            if not keys:
                raise ValueError("open mapping without known keys")
            sub = _nullable(_strictify(extra, defs, depth + 1))
            out["properties"] = {key: sub for key in keys}
        out["type"] = "object"
        out.setdefault("properties", {})
        out["required"] = list(out["properties"])
        out["additionalProperties"] = False
    return out


def _nullable(schema: Any) -> Any:
    if isinstance(schema, dict) and schema.get("type") == "null":
        return schema
    return {"anyOf": [schema, {"type": "null"}]}


def _strategy_schema() -> dict[str, Any]:
    """The strategy schema with every knob optional (the answer holds only the knobs it changes)."""
    schema = Strategy.model_json_schema()
    schema.pop("required", None)
    schema.pop("title", None)
    return schema


def response_schema() -> tuple[dict[str, Any], bool]:
    """The answer's JSON schema and whether it is in the strict subset (strict structured output) or advisory."""
    strategy = _strategy_schema()
    patch = patch_schema() or {"type": "object"}
    loose = {"type": "object", "additionalProperties": False,
             "properties": {"strategy": strategy, "patches": {"type": "array", "items": patch},
                            "rationale": {"type": "string"}},
             "required": ["strategy", "patches", "rationale"]}
    defs = {**strategy.get("$defs", {}), **(patch.get("$defs", {}) if isinstance(patch, dict) else {})}
    try:
        strict = _strictify({k: v for k, v in loose.items()}, defs)
        # The top-level fields are required and not nullable; rationale is a plain string.
        strict["properties"] = {"strategy": strict["properties"]["strategy"]["anyOf"][0],
                                "patches": strict["properties"]["patches"]["anyOf"][0],
                                "rationale": {"type": "string"}}
        return strict, True
    except (ValueError, KeyError):
        return loose, False


_FENCE = re.compile(r"```(?:json|JSON)?\s*(.*?)```", re.S)


def extract_json(text: str) -> Any:
    """The answer as JSON: the whole text, else the first fenced block, else the first balanced `{...}` object."""
    text = text.strip()
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        first_error = exc
    for block in _FENCE.findall(text):
        try:
            return json.loads(block.strip())
        except json.JSONDecodeError:
            pass
    decoder = json.JSONDecoder()
    for start in [m.start() for m in re.finditer(r"\{", text)][:50]:
        try:
            obj, _ = decoder.raw_decode(text, start)
            if isinstance(obj, dict):
                return obj
        except json.JSONDecodeError:
            continue
    raise ProposalError(f"invalid JSON: {first_error.msg} at line {first_error.lineno} column {first_error.colno}; "
                        "answer with one JSON object only")


def _drop_nulls(value: Any) -> Any:
    """Strict structured output sends null for 'keep this knob'; remove those before merging."""
    if isinstance(value, dict):
        return {k: _drop_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_drop_nulls(v) for v in value]
    return value


def _merge(base: dict[str, Any], edits: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in edits.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def _apply_patches(schedule: Schedule, patches: list[dict[str, Any]]) -> Schedule:
    """Apply explicit patches through `megasynth.lowering.patches` (its errors name the patch index and field)."""
    if not patches:
        return schedule
    try:
        from megasynth.lowering.patches import apply_patches
    except ImportError:
        raise ProposalError("patches are not supported by this build; send \"patches\": []") from None
    return apply_patches(schedule, patches)


def _canonical(strategy: Strategy, patches: list[dict[str, Any]]) -> str:
    return json.dumps([strategy.model_dump(mode="json"), patches], sort_keys=True, separators=(",", ":"))


# ----------------------------------------------------------------------------------------------------------------
# The proposer


@dataclass
class Usage:
    """Per-run accounting of the agent: calls, tokens, cost, failures, briefing sizes."""

    model: str = ""
    base_url: str | None = None
    calls: int = 0
    rounds: int = 0
    proposals: int = 0
    rounds_given_up: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cost_usd: float | None = None
    errors: dict[str, int] = field(default_factory=dict)
    structured_output: bool = True
    briefing_tokens_last: int = 0
    briefing_tokens_max: int = 0
    briefing_sections_last: dict[str, int] = field(default_factory=dict)
    briefing_budget: int = 0
    accepted: int = 0
    rejected: int = 0

    def to_json(self) -> dict[str, Any]:
        out = dict(self.__dict__)
        out["total_tokens"] = self.prompt_tokens + self.completion_tokens
        return out


class LLMProposer:
    """Proposes one strategy edit + patches per round from an OpenAI-compatible chat endpoint."""

    name = "llm"

    def __init__(self, spec: ModelSpec, workers: int, options: LLMOptions | None = None,
                 run_dir: str | Path | None = None, client: Any = None) -> None:
        self.spec = spec
        self.workers = workers
        self.options = replace(options) if options is not None else LLMOptions()  # own copy: _adapt edits it
        self.run_dir = Path(run_dir) if run_dir is not None else None
        self._client = client
        self._structured = True
        self._max_param = "max_tokens"
        self._send_temperature = True
        self._rebuild = False
        self._failures = 0
        self._schema, self._strict = response_schema()
        self._notes: list[str] = []
        self._schedules: dict[str, Schedule] = {}
        self._profile: tuple[str | None, dict[str, Any]] = (None, {})
        self._seen: dict[str, str] = {}  # canonical proposal -> candidate id + verdict
        self._round = 0
        self._exhausted_noted = False
        self.usage = Usage(model=self.options.resolved_model(),
                           base_url=self.options.base_url or os.environ.get("OPENAI_BASE_URL"),
                           briefing_budget=self.options.budget_tokens)
        self._fatal: str | None = None  # set by 401/403/404: no later round will do better
        self._observed: set[str] = set()  # candidates whose result is in the transcript
        self._resume_usage()

    # -- plumbing ------------------------------------------------------------------------------------------------

    def _get_client(self) -> Any:
        if self._client is None:
            import openai

            self._client = openai.OpenAI(
                base_url=self.options.base_url or os.environ.get("OPENAI_BASE_URL") or None,
                api_key=self.options.api_key or os.environ.get("OPENAI_API_KEY") or "not-needed",
                timeout=self.options.timeout_s, max_retries=0)
        return self._client

    def _log(self, record: dict[str, Any]) -> None:
        """Append one whole JSON line to agent.jsonl (one write call, flushed and fsynced)."""
        if self.run_dir is None:
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        line = json.dumps({"ts": datetime.now(UTC).isoformat(timespec="milliseconds"), "round": self._round,
                           **record}, default=str) + "\n"
        with open(self.run_dir / "agent.jsonl", "a", encoding="utf-8") as fh:
            fh.write(line)
            fh.flush()
            os.fsync(fh.fileno())

    def _save_usage(self) -> None:
        if self.run_dir is not None:
            write_json_atomic(self.run_dir / "agent_usage.json", self.usage.to_json())

    def _resume_usage(self) -> None:
        """A resumed run keeps counting its calls, tokens and cost from where it stopped."""
        if self.run_dir is None or not (self.run_dir / "agent_usage.json").exists():
            return
        try:
            old = json.loads((self.run_dir / "agent_usage.json").read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError):
            return
        for k in ("calls", "rounds", "proposals", "rounds_given_up", "prompt_tokens", "completion_tokens",
                  "accepted", "rejected"):
            if isinstance(old.get(k), int):
                setattr(self.usage, k, old[k])
        if isinstance(old.get("errors"), dict):
            self.usage.errors = {str(k): int(v) for k, v in old["errors"].items() if isinstance(v, int)}
        self._round = self.usage.rounds
        try:
            with open(self.run_dir / "agent.jsonl", encoding="utf-8") as fh:
                for line in fh:
                    if '"type": "result"' in line:
                        try:
                            self._observed.add(str(json.loads(line)["candidate"]))
                        except (json.JSONDecodeError, KeyError):
                            continue  # a line cut by a kill: the result is recorded again
        except OSError:
            pass

    def _error(self, kind: str) -> None:
        self.usage.errors[kind] = self.usage.errors.get(kind, 0) + 1

    def _schedule_for(self, result: Result | None) -> Schedule | None:
        """The schedule a result was evaluated on, rebuilt by lowering + patching (deterministic), cached."""
        strategy = result.proposal.strategy if result is not None else Strategy()
        patches = result.proposal.patches if result is not None else []
        key = _canonical(strategy, patches)
        if key not in self._schedules:
            try:
                self._schedules = {key: _apply_patches(lower(self.spec, self.workers, strategy), patches)}
            except (ScheduleError, ProposalError, ValueError, KeyError):
                return None
        return self._schedules[key]

    # -- the protocol ---------------------------------------------------------------------------------------------

    @property
    def exhausted(self) -> bool:
        """True once the agent will propose nothing more in this run (call budget spent or a fatal endpoint error)."""
        return self.usage.calls >= self.options.max_calls or bool(self._fatal)

    def propose(self, ctx: SearchContext, n: int) -> list[Proposal]:
        """One round: up to `options.attempts` calls; returns one checked proposal, or none when the round fails."""
        try:
            return self._propose(ctx)
        except Exception as exc:  # noqa: BLE001 - nothing the agent does may crash the search
            self._error("internal")
            self._log({"type": "error", "kind": "internal", "error": f"{type(exc).__name__}: {exc}"})
            self._notes.append(f"round {self._round}: internal error {type(exc).__name__}")
            self._save_usage()
            return []

    def observe(self, result: Result) -> None:
        """Remember how each evaluated proposal fared (the briefing shows the history; this tracks our own)."""
        try:
            self._observe(result)
        except Exception as exc:  # noqa: BLE001 - bookkeeping must never crash the search
            self._error("internal")
            self._notes.append(f"could not record {result.candidate}: {type(exc).__name__}")

    def _observe(self, result: Result) -> None:
        key = _canonical(result.proposal.strategy, result.proposal.patches)
        verdict = ("accepted" + (f" {result.ms:.4f} ms" if result.ms is not None else "")) if result.accepted else \
            screened_text(result.screened) if result.screened is not None else \
            ("rejected" if result.error is None else "not validated")
        self._seen[key] = f"{result.candidate} ({verdict})"
        if result.proposal.proposer == self.name and result.candidate not in self._observed:
            self._observed.add(result.candidate)  # a resumed search replays its history: count and log once
            if result.accepted:
                self.usage.accepted += 1
            else:
                self.usage.rejected += 1
            self._log({"type": "result", "candidate": result.candidate, "accepted": result.accepted, "ms": result.ms,
                       "estimated": result.estimated, "error": result.error,
                       "counterexample": result.counterexample})
            self._save_usage()

    def _propose(self, ctx: SearchContext) -> list[Proposal]:
        opts = self.options
        if self.usage.calls >= opts.max_calls or self._fatal:
            if not self._exhausted_noted:
                self._exhausted_noted = True
                why = self._fatal or f"call budget spent ({opts.max_calls} calls)"
                self._log({"type": "notice", "message": f"the agent stops proposing: {why}"})
            return []
        self._round += 1
        self.usage.rounds += 1
        self._failures = 0  # backoff restarts each round: a round waits at most backoff_s * (2^(attempts-1) - 1)
        for r in ctx.history:  # results the loop did not pass to observe() still count as seen
            self._seen.setdefault(_canonical(r.proposal.strategy, r.proposal.patches),
                                  f"{r.candidate} ({'accepted' if r.accepted else 'rejected'})")
        base_schedule = self._schedule_for(ctx.best)
        profile = None
        if ctx.best is not None:
            if self._profile[0] != ctx.best.candidate:
                self._profile = (ctx.best.candidate, normalise_profile(ctx.best.profile, base_schedule, opts.seq,
                                                                       ctx.best.estimated))
            profile = self._profile[1]

        def brief() -> Briefing:
            b = build_briefing(ctx, self.spec, base_schedule, budget=opts.budget_tokens, seq=opts.seq,
                               notes=self._notes, profile=profile)
            self.usage.briefing_tokens_last = b.tokens
            self.usage.briefing_tokens_max = max(self.usage.briefing_tokens_max, b.tokens)
            self.usage.briefing_sections_last = b.sections
            self.usage.briefing_budget = b.budget
            return b

        briefing = brief()
        messages: list[dict[str, str]] = briefing.messages()
        last_error = "no attempt made"
        for attempt in range(1, opts.attempts + 1):
            if self.usage.calls >= opts.max_calls:
                last_error = f"call budget spent ({opts.max_calls} calls)"
                break
            reply = self._call(messages, briefing, attempt)
            if reply is None:
                last_error = self._last_transport_error
                if self._fatal:
                    break
                if self._rebuild:  # the server's context is smaller than the budget: a smaller briefing
                    self._rebuild = False
                    briefing = brief()
                    messages = briefing.messages()
                continue
            content, finish, refusal = reply
            try:
                proposal = self._check(content, finish, refusal, ctx)
            except ProposalError as exc:
                last_error = str(exc)
                self._error("invalid_answer")
                self._log({"type": "verdict", "attempt": attempt, "ok": False, "error": last_error})
                feedback = last_error[:MAX_ERROR_FEEDBACK]
                messages = [*messages, {"role": "assistant", "content": (content or "")[:4000]},
                            {"role": "user", "content": f"Your answer was not usable: {feedback}\n"
                             "Reply again with one corrected JSON object only."}]
                continue
            self.usage.proposals += 1
            self._log({"type": "verdict", "attempt": attempt, "ok": True,
                       "proposal": {"strategy": proposal.strategy.model_dump(mode="json"),
                                    "patches": proposal.patches, "rationale": proposal.rationale}})
            self._save_usage()
            return [proposal]
        self.usage.rounds_given_up += 1
        note = f"round {self._round} produced no usable proposal: {last_error[:200]}"
        self._notes.append(note)
        self._log({"type": "notice", "message": note})
        self._save_usage()
        return []

    _last_transport_error = ""

    def _adapt(self, exc: Exception) -> str | None:
        """A 400 says the request does not suit this server: change the one thing it names, say what (or None)."""
        msg = _short(exc).lower()
        if "context" in msg and any(w in msg for w in ("length", "window", "too long", "maximum", "exceed")) \
                and self.options.budget_tokens > 1500:
            self.options.budget_tokens = max(1500, self.options.budget_tokens // 2)
            self._rebuild = True
            return f"briefing budget lowered to {self.options.budget_tokens} tokens"
        if "max_tokens" in msg and self._max_param == "max_tokens":
            self._max_param = "max_completion_tokens"
            return "retrying with max_completion_tokens"
        if "temperature" in msg and self._send_temperature:
            self._send_temperature = False
            return "retrying without temperature"
        if self._structured:
            # Most often: this server does not take response_format json_schema. Fall back to plain text.
            self._structured = False
            self.usage.structured_output = False
            return "retrying without response_format (plain text + JSON extraction)"
        return None

    def _call(self, messages: list[dict[str, str]], briefing: Briefing, attempt: int
              ) -> tuple[str, str | None, str | None] | None:
        """One API call with transcript; None on a transport failure (after the backoff it asks for)."""
        import openai

        opts = self.options
        kwargs: dict[str, Any] = {"model": opts.resolved_model(), "messages": messages,
                                  self._max_param: opts.max_output_tokens}
        if self._send_temperature:
            kwargs["temperature"] = opts.temperature
        if self._structured:
            kwargs["response_format"] = {"type": "json_schema", "json_schema": {
                "name": "schedule_proposal", "strict": self._strict, "schema": self._schema}}
        self.usage.calls += 1
        self._log({"type": "request", "attempt": attempt, "call": self.usage.calls, "model": kwargs["model"],
                   "temperature": opts.temperature, "structured": self._structured, "strict": self._strict,
                   "briefing": {"tokens": briefing.tokens, "budget": briefing.budget, "level": briefing.level,
                                "truncated": briefing.truncated, "sections": briefing.sections},
                   "messages": messages})
        t0 = time.monotonic()
        try:
            resp = self._get_client().chat.completions.create(**kwargs, timeout=opts.timeout_s)
        except openai.APITimeoutError:
            return self._transport("timeout", f"no reply within {opts.timeout_s:g} s", t0, attempt)
        except openai.RateLimitError as exc:
            return self._transport("rate_limit", "429 rate limited", t0, attempt, _retry_after(exc))
        except openai.APIStatusError as exc:
            fix = self._adapt(exc) if exc.status_code in (400, 413, 422) else None
            if fix is not None:
                return self._transport("request_adapted", f"HTTP {exc.status_code}: {_short(exc)[:120]}; {fix}",
                                       t0, attempt, 0)
            kind = "server_error" if exc.status_code >= 500 else f"http_{exc.status_code}"
            if exc.status_code in (401, 403, 404):  # bad key, no access, unknown model/path: retrying cannot help
                self._fatal = f"HTTP {exc.status_code}: {_short(exc)[:160]} (check OPENAI_API_KEY, " \
                              "OPENAI_BASE_URL and --llm-model)"
                return self._transport(kind, self._fatal, t0, attempt, 0)
            return self._transport(kind, f"HTTP {exc.status_code}: {_short(exc)}", t0, attempt)
        except openai.APIConnectionError as exc:
            return self._transport("connection", f"connection failed: {_short(exc)}", t0, attempt)
        except openai.OpenAIError as exc:
            return self._transport("api_error", f"{type(exc).__name__}: {_short(exc)}", t0, attempt)
        latency = time.monotonic() - t0
        self._failures = 0
        usage = getattr(resp, "usage", None)
        pt = int(getattr(usage, "prompt_tokens", 0) or 0)
        ct = int(getattr(usage, "completion_tokens", 0) or 0)
        self.usage.prompt_tokens += pt
        self.usage.completion_tokens += ct
        if opts.price_in_per_mtok is not None or opts.price_out_per_mtok is not None:
            self.usage.cost_usd = round((self.usage.prompt_tokens * (opts.price_in_per_mtok or 0)
                                         + self.usage.completion_tokens * (opts.price_out_per_mtok or 0)) / 1e6, 6)
        choice = resp.choices[0] if getattr(resp, "choices", None) else None
        message = getattr(choice, "message", None)
        content = getattr(message, "content", None) or ""
        refusal = getattr(message, "refusal", None)
        finish = getattr(choice, "finish_reason", None)
        self._log({"type": "response", "attempt": attempt, "call": self.usage.calls, "latency_s": round(latency, 3),
                   "finish_reason": finish, "refusal": refusal, "usage": {"prompt_tokens": pt,
                                                                          "completion_tokens": ct},
                   "content": content[:MAX_REPLY_CHARS + 1000]})
        self._save_usage()
        return content, finish, refusal

    def _transport(self, kind: str, message: str, t0: float, attempt: int, wait: float | None = None) -> None:
        self._error(kind)
        self._last_transport_error = message
        if wait is None:
            self._failures += 1  # consecutive transport failures; a reply resets it
            wait = self.options.backoff_s * 2 ** min(self._failures - 1, 10)
        wait = max(0.0, min(wait, self.options.backoff_max_s))
        self._log({"type": "error", "attempt": attempt, "call": self.usage.calls, "kind": kind, "error": message,
                   "latency_s": round(time.monotonic() - t0, 3), "backoff_s": round(wait, 3)})
        self._save_usage()
        if wait > 0 and attempt < self.options.attempts:
            time.sleep(wait)
        return None

    def _check(self, content: str, finish: str | None, refusal: str | None, ctx: SearchContext) -> Proposal:
        """Parse and check an answer; every defect is a `ProposalError` whose message goes back to the model."""
        opts = self.options
        if refusal:
            raise ProposalError(f"refusal: {str(refusal)[:200]}; this is a performance-tuning task, please answer")
        if finish == "content_filter":
            raise ProposalError("the answer was filtered; answer with the JSON proposal only")
        if len(content) > MAX_REPLY_CHARS or finish == "length":
            cut = ", cut at the token limit" if finish == "length" else ""
            raise ProposalError(f"answer too long ({len(content)} chars{cut}); "
                                f"keep it under {opts.max_output_tokens} tokens and {opts.max_patches} patches")
        if not content.strip():
            raise ProposalError("empty answer; answer with the JSON proposal")
        data = extract_json(content)
        if not isinstance(data, dict):
            raise ProposalError(f"$: expected a JSON object, got {type(data).__name__}")
        unknown = sorted(set(data) - {"strategy", "patches", "rationale"})
        if unknown:
            raise ProposalError(f"$.{unknown[0]}: unknown key (allowed: strategy, patches, rationale)")
        edits = _drop_nulls(data.get("strategy") or {})
        if not isinstance(edits, dict):
            raise ProposalError(f"$.strategy: expected an object, got {json.dumps(edits)[:80]}")
        patches = data.get("patches") or []
        if not isinstance(patches, list) or not all(isinstance(p, dict) for p in patches):
            raise ProposalError("$.patches: expected a list of patch objects")
        if len(patches) > opts.max_patches:
            raise ProposalError(f"$.patches: {len(patches)} patches; at most {opts.max_patches} per proposal")
        patches = [_drop_nulls(p) for p in patches]
        rationale = data.get("rationale", "")
        if not isinstance(rationale, str):
            raise ProposalError("$.rationale: expected a string")
        base = (ctx.best.proposal.strategy if ctx.best is not None else Strategy()).model_dump(mode="json")
        try:
            strategy = Strategy.model_validate(_merge(base, edits))
        except ValidationError as exc:
            err = max(exc.errors(include_url=False), key=lambda e: len(e["loc"]))
            value = json.dumps(err.get("input"), default=str)[:80]
            raise ProposalError(f"{json_path(('strategy', *err['loc']))}: {err['msg']} (got {value})") from None
        key = _canonical(strategy, patches)
        if key in self._seen:
            raise ProposalError(f"this exact proposal was already evaluated as candidate {self._seen[key]}; "
                                "propose something different")
        try:
            schedule = lower(self.spec, self.workers, strategy)
        except (ScheduleError, ValueError, KeyError) as exc:
            raise ProposalError(f"$.strategy: the lowering failed: {exc}") from None
        if patches:
            try:
                patched = _apply_patches(schedule, patches)
                resolve(patched)  # structure only (ids, queues, counter ranges): cheap, and names the JSON path
            except ProposalError:
                raise
            except ScheduleError as exc:  # PatchError names $.patches[k].field; resolve() names the schedule path
                where = "" if exc.path.startswith("$.patches") else "after the patches, the schedule at "
                raise ProposalError(f"{where}{exc.path}: {exc.message}") from None
            except (ValueError, KeyError, IndexError, TypeError) as exc:
                raise ProposalError(f"$.patches: {exc}") from None
        line = " ".join(rationale.split())[:200]
        return Proposal(strategy, patches, line, self.name, ctx.best.candidate if ctx.best is not None else None)


def _retry_after(exc: Any) -> float | None:
    try:
        value = exc.response.headers.get("retry-after")
        return float(value) if value is not None else None
    except (AttributeError, ValueError, TypeError):
        return None


def _short(exc: Exception) -> str:
    return " ".join(str(exc).split())[:200]


def make_llm_proposer(spec: ModelSpec, workers: int, run_dir: str | Path | None = None,
                      options: LLMOptions | None = None) -> LLMProposer:
    """The agent as the search loop builds it (`--proposer llm`, or `auto` with an endpoint configured)."""
    return LLMProposer(spec, workers, options, run_dir)
