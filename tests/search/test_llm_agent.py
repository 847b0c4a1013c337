"""The LLM agent against a real OpenAI-compatible HTTP server on 127.0.0.1 (scripted replies), driven by the real
`openai` client: structured output and its fallback, error feedback, bounded retries on timeouts/429/5xx, the
transcript, the token budget of the briefing, and the whole search on `tiny`."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from megasynth.lowering.lower import lower
from megasynth.lowering.models import get_model
from megasynth.lowering.strategy import Strategy
from megasynth.search.briefing import build_briefing, compact_counterexample, count_tokens
from megasynth.search.proposers.base import Proposal, Result, SearchContext
from megasynth.search.proposers.llm import LLMOptions, LLMProposer, agent_configured, extract_json, response_schema

# ---------------------------------------------------------------------------------------------------------------
# A scripted OpenAI-compatible server


class ScriptedServer:
    """Serves /v1/chat/completions from a script of replies; records every request body it receives.

    Script items: ("ok", content) | ("status", code[, message]) | ("slow", seconds, content) | ("refusal", text)
    | ("no_format", content) (400 when the request carries response_format, else content)."""

    def __init__(self, script: list[tuple[Any, ...]]) -> None:
        self.script = list(script)
        self.requests: list[dict[str, Any]] = []
        self.lock = threading.Lock()
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def do_POST(self) -> None:  # noqa: N802 - http.server's naming
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
                if self.path.rstrip("/") != "/v1/chat/completions":
                    return self._send(404, {"error": {"message": "not found"}})
                with server.lock:
                    server.requests.append(body)
                    item = server.script.pop(0) if server.script else ("status", 500)
                kind = item[0]
                if kind == "status":
                    headers = {"retry-after": "0"} if item[1] == 429 else {}
                    message = item[2] if len(item) > 2 else f"scripted {item[1]}"
                    return self._send(item[1], {"error": {"message": message, "type": "scripted"}}, headers)
                if kind == "slow":
                    time.sleep(item[1])
                    return self._reply(body, item[2])
                if kind == "no_format" and "response_format" in body:
                    return self._send(400, {"error": {"message": "response_format json_schema is not supported"}})
                if kind == "refusal":
                    return self._reply(body, None, refusal=item[1])
                return self._reply(body, item[1])

            def _reply(self, body: dict[str, Any], content: str | None, refusal: str | None = None) -> None:
                prompt = sum(len(m.get("content") or "") for m in body.get("messages", [])) // 4
                done = len(content or "") // 4
                self._send(200, {"id": "chatcmpl-test", "object": "chat.completion", "created": 0,
                                 "model": body.get("model", "scripted"),
                                 "choices": [{"index": 0, "finish_reason": "stop",
                                              "message": {"role": "assistant", "content": content,
                                                          "refusal": refusal}}],
                                 "usage": {"prompt_tokens": prompt, "completion_tokens": done,
                                           "total_tokens": prompt + done}})

            def _send(self, code: int, payload: dict[str, Any], headers: dict[str, str] | None = None) -> None:
                data = json.dumps(payload).encode()
                try:
                    self.send_response(code)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(data)))
                    for k, v in (headers or {}).items():
                        self.send_header(k, v)
                    self.end_headers()
                    self.wfile.write(data)
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the client gave up (the slow reply): expected

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"

    def __enter__(self) -> ScriptedServer:
        self.thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def _answer(strategy: dict[str, Any] | None = None, patches: list[dict[str, Any]] | None = None,
            rationale: str = "test") -> str:
    return json.dumps({"strategy": strategy or {}, "patches": patches or [], "rationale": rationale})


def _options(server: ScriptedServer, **kw: Any) -> LLMOptions:
    base = {"model": "scripted", "base_url": server.base_url, "api_key": "sk-test", "timeout_s": 2.0,
            "attempts": 3, "max_calls": 20, "backoff_s": 0.01, "backoff_max_s": 0.05, "seq": 64}
    return LLMOptions(**{**base, **kw})


def _ctx(history: list[Result] | None = None, best: Result | None = None) -> SearchContext:
    history = history or []
    return SearchContext("tiny", 8, "NVIDIA H200", best, history, best.ms if best else None, True)


def _naive_result() -> Result:
    return Result("c0000", Proposal(Strategy(), proposer="naive"), True, 0.05, True)


def _transcript(run_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run_dir / "agent.jsonl").read_text().splitlines()]


TINY = get_model("tiny")

# ---------------------------------------------------------------------------------------------------------------
# Parsing and schema


def test_extract_json_from_text_fences_and_prose() -> None:
    assert extract_json('{"a": 1}') == {"a": 1}
    assert extract_json('Sure!\n```json\n{"strategy": {}, "patches": []}\n```\nDone.') == {"strategy": {},
                                                                                          "patches": []}
    assert extract_json('I propose {"rationale": "x", "strategy": {"attn_splits": 2}} as my answer') == {
        "rationale": "x", "strategy": {"attn_splits": 2}}
    with pytest.raises(ValueError, match="invalid JSON"):
        extract_json("{not json at all")


def test_response_schema_accepts_a_proposal() -> None:
    jsonschema = pytest.importorskip("jsonschema")
    schema, strict = response_schema()
    answer = {"strategy": {"attn_splits": 2}, "patches": [], "rationale": "x"}
    if strict:  # strict mode: every knob present, null = keep
        props = schema["properties"]["strategy"]["properties"]
        answer["strategy"] = {k: None for k in props} | {"attn_splits": 2}
    jsonschema.validate(answer, schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"strategy": {}, "patches": [], "rationale": "x", "extra": 1}, schema)


def test_agent_configured_by_env() -> None:
    assert not agent_configured({})
    assert agent_configured({"OPENAI_BASE_URL": "http://localhost:8000/v1"})
    assert agent_configured({"OPENAI_API_KEY": "sk-x"})
    assert not agent_configured({"OPENAI_API_KEY": ""})


# ---------------------------------------------------------------------------------------------------------------
# The briefing


def test_briefing_contents_and_measured_budget() -> None:
    spec = get_model("llama-1b")
    schedule = lower(spec, 132)
    best = Result("c0000", Proposal(Strategy(), proposer="naive"), True, 1.5, True,
                  profile={"per_op_ms": {"mlp_norm_gate_up": 0.5, "down_proj_residual": 0.3},
                           "per_sm_idle_ms": [0.1 * (w % 7) for w in range(132)],
                           "critical_path": list(range(0, 400, 3))})
    rejected = Result("c0001", Proposal(Strategy(), [{"op": "remove_wait", "id": 5}], "x", "llm"), False,
                      counterexample={"findings": [{"category": "race", "message": "#1 and #5 race on x[0:16]",
                                                    "instructions": [1, 5],
                                                    "details": {"interleaving": [f"event {k}" for k in range(30)]}}]})
    ctx = SearchContext("llama-1b", 132, "NVIDIA H200", best, [best, rejected] * 15, 1.5, True)
    full = build_briefing(ctx, spec, schedule, budget=8000)
    assert full.tokens <= 8000 and full.level == 0 and not full.truncated
    assert full.tokens == count_tokens(full.system) + count_tokens(full.user)
    for needle in ("attn_partial", "kv_head", "Critical path", "Idle per SM", "estimated", "race: #1 and #5",
                   "mlp_norm_gate_up L0", "\"attn_splits\"", "4.19 TB/s", "c0001",
                   "same pattern, ids +832 and signalled counters +6 per layer", '"op":"remove_wait"'):
        assert needle in full.user, needle
    assert set(full.sections) >= {"system", "model", "hardware", "strategy", "patches", "layout", "best", "history",
                                  "counterexamples"}
    tight = build_briefing(ctx, spec, schedule, budget=3000)
    assert tight.level > 0 and tight.tokens <= 3000 and tight.tokens < full.tokens
    assert "race: #1 and #5" in tight.user  # the counterexample survives the trimming


def test_critical_path_folds_repeated_layers() -> None:
    from megasynth.search.briefing import _path_runs

    path = [{"id": 0, "op": "embed", "layer": None}]
    for layer in range(4):
        base = 10 * layer
        path += [{"id": base + 1, "op": "a", "layer": layer}, {"id": base + 2, "op": "b", "layer": layer},
                 {"id": base + 3, "op": "b", "layer": layer}]
    path.append({"id": 99, "op": "head", "layer": None})
    assert _path_runs(path, 10) == ("embed#0 -> [layers 0..3, each: a -> b (x2); layer 0 ids: L0#1, L0#2..3 (x2)] "
                                    "-> head#99")


def test_compact_counterexample_is_bounded() -> None:
    cex = {"findings": [{"category": "deadlock", "message": "m" * 5000, "instructions": list(range(100))}]}
    text = compact_counterexample(cex, chars=300)
    assert len(text) <= 300 and text.startswith("deadlock:")


def test_briefing_estimates_the_profile_when_missing() -> None:
    schedule = lower(TINY, 8)
    best = _naive_result()
    b = build_briefing(_ctx([best], best), TINY, schedule, seq=64)
    assert "Profile source: cost model (estimated)" in b.user and "Critical path" in b.user


def test_briefing_reads_a_trace_in_the_shared_format() -> None:
    costmodel = pytest.importorskip("megasynth.lowering.costmodel")
    pytest.importorskip("megasynth.trace")
    schedule = lower(TINY, 8)
    est = costmodel.estimate(schedule, 64)
    best = Result("c0003", Proposal(Strategy(), proposer="heuristic"), True, est.makespan_ms, False,
                  profile={"trace": est.trace})
    text = build_briefing(_ctx([best], best), TINY, schedule, seq=64).user
    assert "Profile source: cost model trace (estimated)" in text  # the trace's own label wins
    assert "Spin-waiting on counters per SM" in text and "final_norm_lm_head#81" in text


# ---------------------------------------------------------------------------------------------------------------
# The proposer against the server


def test_malformed_then_good_answer_feeds_the_error_back(tmp_path: Path) -> None:
    good = _answer({"attn_splits": 2, "tiles": {"mlp_norm_gate_up": 32}}, rationale="split attention\nmore")
    with ScriptedServer([("ok", "{this is not json"), ("ok", good)]) as srv:
        prop = LLMProposer(TINY, 8, _options(srv), run_dir=tmp_path)
        best = _naive_result()
        out = prop.propose(_ctx([best], best), 1)
    assert len(out) == 1
    p = out[0]
    assert p.strategy.attn_splits == 2 and p.strategy.tiles["mlp_norm_gate_up"] == 32
    assert p.strategy.tiles["o_proj_residual"] == Strategy().tiles["o_proj_residual"]  # merged onto the best
    assert p.rationale == "split attention more" and p.proposer == "llm" and p.parent == "c0000"
    assert len(srv.requests) == 2
    second = json.dumps(srv.requests[1]["messages"])
    assert "invalid JSON" in second and "{this is not json" in second
    assert srv.requests[0]["response_format"]["type"] == "json_schema"
    kinds = [r["type"] for r in _transcript(tmp_path)]
    assert kinds == ["request", "response", "verdict", "request", "response", "verdict"]
    usage = json.loads((tmp_path / "agent_usage.json").read_text())
    assert usage["calls"] == 2 and usage["proposals"] == 1 and usage["prompt_tokens"] > 500


def test_out_of_range_and_unknown_keys_are_fed_back(tmp_path: Path) -> None:
    script = [("ok", _answer({"attn_splits": 100000})), ("ok", json.dumps({"strategy": {}, "oops": 1})),
              ("ok", _answer({"assignment": "zigzag"} if "zigzag" in json.dumps(Strategy.model_json_schema())
                             else {"attn_splits": 4}))]
    with ScriptedServer(script) as srv:
        out = LLMProposer(TINY, 8, _options(srv), run_dir=tmp_path).propose(_ctx(), 1)
    assert len(out) == 1
    assert "$.strategy.attn_splits" in json.dumps(srv.requests[1]["messages"])
    assert "$.oops: unknown key" in json.dumps(srv.requests[2]["messages"])


def test_bad_patches_are_fed_back_with_their_path(tmp_path: Path) -> None:
    pytest.importorskip("megasynth.lowering.patches")
    script = [("ok", _answer(patches=[{"op": "remove_wait", "id": 99999, "counter": 0}])),
              ("ok", _answer(patches=[{"op": "add_wait", "id": 9, "counter": 5, "value": 1, "colour": "red"}])),
              ("ok", _answer(patches=[{"op": "move", "id": 9, "worker": 3, "position": 0}]))]
    with ScriptedServer(script) as srv:
        out = LLMProposer(TINY, 8, _options(srv), run_dir=tmp_path).propose(_ctx(), 1)
    assert len(out) == 1 and out[0].patches == [{"op": "move", "id": 9, "worker": 3, "position": 0}]
    assert "$.patches[0].id: instruction 99999 does not exist" in json.dumps(srv.requests[1]["messages"])
    assert "$.patches[0].colour" in json.dumps(srv.requests[2]["messages"])


def test_transport_failures_are_retried_then_the_round_gives_up(tmp_path: Path) -> None:
    script = [("status", 429), ("status", 503), ("slow", 4.0, _answer())]
    with ScriptedServer(script) as srv:
        prop = LLMProposer(TINY, 8, _options(srv, timeout_s=2.0), run_dir=tmp_path)
        t0 = time.monotonic()
        out = prop.propose(_ctx(), 1)
        elapsed = time.monotonic() - t0
    assert out == [] and elapsed < 10
    assert prop.usage.errors == {"rate_limit": 1, "server_error": 1, "timeout": 1}
    assert prop.usage.rounds_given_up == 1
    log = _transcript(tmp_path)
    assert [r["kind"] for r in log if r["type"] == "error"] == ["rate_limit", "server_error", "timeout"]
    assert log[-1]["type"] == "notice" and "no usable proposal" in log[-1]["message"]


def test_refusal_and_duplicate_are_rejected_and_budget_is_bounded(tmp_path: Path) -> None:
    best = _naive_result()
    script = [("refusal", "I can't help with that"), ("ok", _answer()), ("ok", _answer({"attn_splits": 2}))]
    with ScriptedServer(script) as srv:
        prop = LLMProposer(TINY, 8, _options(srv, max_calls=3), run_dir=tmp_path)
        out = prop.propose(_ctx([best], best), 1)
        assert len(out) == 1 and out[0].strategy.attn_splits == 2
        assert "refusal" in json.dumps(srv.requests[1]["messages"])
        assert "already evaluated as candidate c0000" in json.dumps(srv.requests[2]["messages"])
        assert prop.propose(_ctx([best], best), 1) == []  # call budget spent: no request is sent
        assert len(srv.requests) == 3


def test_huge_answer_is_refused_with_a_size_hint(tmp_path: Path) -> None:
    huge = _answer(rationale="x" * 50_000)
    with ScriptedServer([("ok", huge), ("ok", _answer({"attn_splits": 2}))]) as srv:
        out = LLMProposer(TINY, 8, _options(srv), run_dir=tmp_path).propose(_ctx(), 1)
    assert len(out) == 1
    fed_back = srv.requests[1]["messages"]
    assert "answer too long" in fed_back[-1]["content"] and len(fed_back[-2]["content"]) <= 4000


def test_fallback_without_structured_output(tmp_path: Path) -> None:
    fenced = "Here is my proposal:\n```json\n" + _answer({"attn_splits": 2}) + "\n```"
    with ScriptedServer([("no_format", fenced), ("no_format", fenced)]) as srv:
        prop = LLMProposer(TINY, 8, _options(srv), run_dir=tmp_path)
        out = prop.propose(_ctx(), 1)
    assert len(out) == 1 and out[0].strategy.attn_splits == 2
    assert "response_format" in srv.requests[0] and "response_format" not in srv.requests[1]
    assert prop.usage.structured_output is False


def test_unreachable_server_never_raises(tmp_path: Path) -> None:
    opts = LLMOptions(model="m", base_url="http://127.0.0.1:9/v1", api_key="x", timeout_s=0.5, attempts=2,
                      backoff_s=0.01, backoff_max_s=0.01)
    prop = LLMProposer(TINY, 8, opts, run_dir=tmp_path)
    assert prop.propose(_ctx(), 1) == []
    assert prop.usage.errors.get("connection") == 2


def test_requests_adapt_to_what_a_400_names(tmp_path: Path) -> None:
    script = [("status", 400, "This model's maximum context length is 2048 tokens, you requested 3000"),
              ("status", 400, "Unsupported parameter: 'max_tokens'; use 'max_completion_tokens' instead"),
              ("ok", _answer({"attn_splits": 2}))]
    with ScriptedServer(script) as srv:
        prop = LLMProposer(TINY, 8, _options(srv, budget_tokens=4000), run_dir=tmp_path)
        out = prop.propose(_ctx(), 1)
    assert len(out) == 1
    size = [len(json.dumps(r["messages"])) for r in srv.requests]
    assert size[1] < size[0]  # the briefing was rebuilt for a 2000-token budget
    assert prop.options.budget_tokens == 2000 and prop.usage.briefing_tokens_last <= 2000
    assert "max_tokens" in srv.requests[1] and "max_completion_tokens" in srv.requests[2]
    assert "response_format" in srv.requests[2]  # structured output was not given up for an unrelated 400


def test_bad_key_stops_the_agent_and_usage_resumes(tmp_path: Path) -> None:
    with ScriptedServer([("status", 401, "Incorrect API key provided")]) as srv:
        prop = LLMProposer(TINY, 8, _options(srv), run_dir=tmp_path)
        assert prop.propose(_ctx(), 1) == [] and prop.propose(_ctx(), 1) == []
        assert len(srv.requests) == 1  # no retry, no second round
    assert "check OPENAI_API_KEY" in _transcript(tmp_path)[-1]["message"]
    again = LLMProposer(TINY, 8, LLMOptions(model="m", base_url="http://127.0.0.1:9/v1"), run_dir=tmp_path)
    assert again.usage.calls == 1 and again.usage.errors == {"http_401": 1}  # a resumed run keeps counting


# ---------------------------------------------------------------------------------------------------------------
# The whole search on `tiny`, the agent as its proposer


def test_auto_picks_the_agent_only_with_an_endpoint(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    proposers = pytest.importorskip("megasynth.search.proposers.auto")
    for key in ("OPENAI_API_KEY", "OPENAI_BASE_URL"):
        monkeypatch.delenv(key, raising=False)
    notices: list[str] = []
    chain = proposers.resolve_proposer("auto", "tiny", 8, notice=notices.append)
    assert not isinstance(chain, LLMProposer) and len(notices) == 1 and "no LLM agent" in notices[0]
    with pytest.raises(ValueError, match="OPENAI_API_KEY or OPENAI_BASE_URL"):
        proposers.resolve_proposer("llm", "tiny", 8)
    monkeypatch.setenv("OPENAI_BASE_URL", "http://127.0.0.1:9/v1")
    agent = proposers.resolve_proposer("llm", "tiny", 8, run_dir=tmp_path, model="m", max_calls=7)
    assert isinstance(agent, LLMProposer) and agent.options.max_calls == 7 and agent.options.model == "m"
    auto = proposers.resolve_proposer("auto", "tiny", 8, run_dir=tmp_path, model="m", max_calls=7)
    assert isinstance(auto, proposers.FallbackProposer) and isinstance(auto.agent, LLMProposer)  # built-in after it


def test_search_with_the_agent_rejects_the_racy_proposal_and_shows_its_counterexample(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from megasynth.search.config import SearchConfig
    from megasynth.search.loop import run_search

    pytest.importorskip("megasynth.lowering.patches")
    naive = lower(TINY, 8)
    victim = next(i for i in naive.instructions if i.op == "o_proj_residual" and i.layer == 0)
    racy = _answer(patches=[{"op": "remove_wait", "id": victim.id, "counter": victim.waits[0].counter}],
                   rationale="o_proj does not need to wait for attn_reduce")
    good = _answer({"attn_splits": 2}, rationale="split attention over the sequence")
    script = [("ok", racy),  # round 1: a racy proposal (validator rejects it)
              ("ok", "{\"strategy\": {\"attn_splits\": 2,"), ("status", 429), ("ok", good),  # round 2
              ("slow", 4.0, _answer()), ("ok", _answer({"tiles": {"mlp_norm_gate_up": 32}}))]  # round 3
    monkeypatch.setenv("OPENAI_BASE_URL", "")
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    with ScriptedServer(script) as srv:
        monkeypatch.setenv("OPENAI_BASE_URL", srv.base_url)
        cfg = SearchConfig(model="tiny", workers=8, proposer="llm", budget=4, seed=0, runs_dir=tmp_path, run="agent",
                           interleavings=20, final_interleavings=50, ctx=64, gpu=False, progress=False, jobs=1,
                           notice=lambda m: None,
                           llm={"model": "scripted", "timeout_s": 2.0, "max_calls": 12, "attempts": 3,
                                "backoff_s": 0.01, "backoff_max_s": 0.05})
        summary = run_search(cfg)
    run = tmp_path / "agent"
    # The search finished its budget: baseline + 3 agent proposals.
    assert summary.evaluated == 4 and summary.accepted == 3 and summary.rejected == 1
    # The racy one was rejected by the validator, with a race counterexample naming the patched instruction.
    rejected = json.loads((run / "rejected" / "c0001.json").read_text())
    assert rejected["proposer"] == "llm" and rejected["findings"][0]["category"] == "race"
    assert victim.id in rejected["findings"][0]["instructions"]
    # ... and its counterexample is in the very next request the server received.
    nxt = srv.requests[1]["messages"][-1]["content"]
    assert "Validator counterexamples" in nxt and "race on attn" in nxt and f"#{victim.id} o_proj_residual" in nxt
    assert "c0001 [llm]" in nxt and "REJECTED by the validator (race)" in nxt
    # Malformed JSON was fed back, the 429 and the timeout retried, the good ones accepted and recorded.
    assert "invalid JSON" in json.dumps(srv.requests[2]["messages"])
    good_timing = json.loads((run / "candidates" / "c0002" / "timing.json").read_text())
    assert good_timing["proposer"] == "llm" and good_timing["strategy"]["attn_splits"] == 2
    assert good_timing["rationale"] == "split attention over the sequence" and good_timing["estimated"] is True
    assert json.loads((run / "candidates" / "c0003" / "timing.json").read_text())["parent"] is not None
    # Every request and every response (or transport error) is in the transcript.
    log = _transcript(run)
    requests = [r for r in log if r["type"] == "request"]
    answers = [r for r in log if r["type"] in ("response", "error")]
    assert len(requests) == len(srv.requests) == 6 and len(answers) == 6
    assert [r["messages"] for r in requests] == [b["messages"] for b in srv.requests]
    assert sorted(r["kind"] for r in log if r["type"] == "error") == ["rate_limit", "timeout"]
    assert [r["accepted"] for r in log if r["type"] == "result"] == [False, True, True]
    usage = json.loads((run / "agent_usage.json").read_text())
    assert usage["calls"] == 6 and usage["proposals"] == 3 and usage["accepted"] == 2 and usage["rejected"] == 1
    assert usage["total_tokens"] > 0 and usage["briefing_tokens_max"] <= usage["briefing_budget"]
    # Resumed: the history is replayed to the agent without counting or logging it twice; calls keep counting.
    with ScriptedServer([("ok", _answer({"attn_splits": 4}))]) as srv2:
        monkeypatch.setenv("OPENAI_BASE_URL", srv2.base_url)
        cfg.budget, cfg.resume = 5, True
        assert run_search(cfg).evaluated == 1
    assert "c0003 [llm]" in srv2.requests[0]["messages"][-1]["content"]
    usage = json.loads((run / "agent_usage.json").read_text())
    assert usage["calls"] == 7 and usage["accepted"] == 3 and usage["rejected"] == 1
    assert [r["candidate"] for r in _transcript(run) if r["type"] == "result"] == ["c0001", "c0002", "c0003", "c0004"]


def test_briefing_preview_command(capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("megasynth.lowering.costmodel")
    from megasynth.search.briefing import main

    assert main(["--model", "tiny", "--workers", "8", "--ctx", "64"]) == 0
    out, err = capsys.readouterr()
    assert out.startswith("You tune megakernel schedules") and "## Best so far" in out
    assert "tokens (budget 8000, detail level 0)" in err
    assert main(["--model", "nope"]) == 2 and "unknown model" in capsys.readouterr().err
    assert main(["--model", "tiny", "--workers", "8", "--ctx", "64", "--batch", "3"]) == 0  # a batch's briefing
    assert "Batch: 3 sequences per step" in capsys.readouterr().out
    assert main(["--model", "tiny", "--batch", "17"]) == 2 and "--batch 17" in capsys.readouterr().err


def test_briefing_names_the_model_features() -> None:
    """The briefing tells the agent what a Qwen model adds and which QKV tiles that allows (a Llama's says nothing):
    the QK-norm rule with this model's numbers, the bias."""
    texts = {}
    for name in ("qwen3-0.6b", "qwen2.5-0.5b", "llama-1b"):
        spec = get_model(name)
        texts[name] = build_briefing(_ctx(), spec, lower(spec, 132), seq=256).user
    assert "qk_norm" in texts["qwen3-0.6b"] and "multiples of head_dim 128" in texts["qwen3-0.6b"]
    assert "below 3072 (the end of the k rows)" in texts["qwen3-0.6b"]  # 16 q heads + 8 k heads of 128
    assert "qkv_bias" not in texts["qwen3-0.6b"]
    assert "Model features: qkv_bias" in texts["qwen2.5-0.5b"] and "RMSNorm over each q" not in texts["qwen2.5-0.5b"]
    assert "Model features" not in texts["llama-1b"]


def test_briefing_names_the_batch_and_what_it_runs_on() -> None:
    """At a batch the agent is told the batch, the interpreter it runs on with that interpreter's limits (v10's pair
    tiles and full ring slots, a QK-norm model's norm apart or inside attention; v9's whole heads where v10 cannot
    build the batch), and that wide instructions pay; at batch 1, one sequence per step."""
    from megasynth.lowering.models import get_model, with_batch

    one = build_briefing(_ctx(), TINY, lower(TINY, 4), seq=64).user
    spec = with_batch(TINY, 4)
    four = build_briefing(_ctx(), spec, lower(spec, 4), seq=64).user
    assert "Batch: one sequence per step." in one and "interpreter v9" not in one
    assert "Batch: 4 sequences per step" in four and "interpreter v10" in four and "RoPE pairs" in four
    assert "fuse_attn_reduce only with attn_splits 1" in four
    qk = with_batch(get_model("tiny-qwen3"), 4)
    qk4 = build_briefing(_ctx(), qk, lower(qk, 4), seq=64).user
    assert "interpreter v10" in qk4 and "applies the norm apart or inside attention" in qk4
    mha = with_batch(get_model("tiny-mha"), 4)  # sizes no multiples of 64: v9
    v9 = build_briefing(_ctx(), mha, lower(mha, 4), seq=64).user
    assert "interpreter v9" in v9 and f"multiples of head_dim {mha.config.hd}" in v9
