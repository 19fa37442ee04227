"""The `openai-agents` SDK runs an agent with one function tool against a real `portside serve`
through its Responses model (`OpenAIResponsesModel` over an `AsyncOpenAI` client), to a final
answer, plainly and streamed.

The model is a tiny random-weight one, so the grammar engine makes the turns happen: the first
turn is forced to call the tool (`ModelSettings(tool_choice="required")`), whose arguments are
therefore valid for its schema; the SDK runs the tool, resets tool_choice (to the default
"auto", parsed by `--tool-call-parser hermes`) and asks again; the agent's `output_type` makes
that answer JSON of its schema (`text.format`), which ends the run. Tracing is off: nothing
leaves the machine."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Any, Literal

import jsonschema
import pytest
from pydantic import BaseModel, Field
from server_process import ServerProcess

from portside.testing.tiny import HERMES_TOOLS_TEMPLATE, QWEN_MARKERS, make_tiny_model

pytestmark = pytest.mark.slow  # its own server (CI runs it)
agents = pytest.importorskip("agents")


class Forecast(BaseModel):
    """The agent's final answer."""

    city: Literal["Paris", "Rome"]
    summary: str = Field(max_length=12)


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    model = make_tiny_model(tmp_path_factory.mktemp("qwen3_agents"), "qwen3", added_tokens=QWEN_MARKERS,
                            chat_template=HERMES_TOOLS_TEMPLATE)  # fmt: skip
    proc = ServerProcess(model, tmp_path_factory.mktemp("srv") / "server.log", "--max-model-len", "2048",
                         "--enable-auto-tool-choice", "--tool-call-parser", "hermes")  # fmt: skip
    try:
        yield proc.wait_ready()
    finally:
        proc.kill()


def weather_agent(srv: ServerProcess, calls: list[dict[str, Any]]) -> Any:
    """An agent with one tool, `get_weather`, that records its calls, on portside's Responses API."""
    import openai

    @agents.function_tool
    def get_weather(city: Literal["Paris", "Rome"], unit: Literal["c", "f"]) -> str:
        """The weather now in a city."""
        calls.append({"city": city, "unit": unit})
        return f"Sunny, 21 degrees {unit} in {city}"

    client = openai.AsyncOpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    agent = agents.Agent(
        name="forecaster", instructions="Look the weather up, then answer.", tools=[get_weather], output_type=Forecast,
        model=agents.OpenAIResponsesModel(model="tiny", openai_client=client),
        model_settings=agents.ModelSettings(tool_choice="required", parallel_tool_calls=False, max_tokens=120, temperature=0),
    )  # fmt: skip
    return agent, get_weather


@pytest.mark.parametrize("streamed", [False, True])
def test_agent_calls_its_tool_and_answers(srv: ServerProcess, streamed: bool) -> None:
    agents.set_tracing_disabled(True)
    calls: list[dict[str, Any]] = []
    agent, tool = weather_agent(srv, calls)

    async def run() -> Any:
        if not streamed:
            return await agents.Runner.run(agent, "What is the weather in Paris?", max_turns=4)
        result = agents.Runner.run_streamed(agent, "What is the weather in Paris?", max_turns=4)
        kinds = [event.type async for event in result.stream_events()]
        assert "raw_response_event" in kinds and "run_item_stream_event" in kinds
        return result

    result = asyncio.run(run())
    assert len(calls) == 1, calls  # the tool really ran, once (then tool_choice went back to auto)
    jsonschema.validate(calls[0], tool.params_json_schema)
    assert isinstance(result.final_output, Forecast), result.final_output
    kinds = [item.type for item in result.new_items]
    assert kinds[:2] == ["tool_call_item", "tool_call_output_item"] and kinds[-1] == "message_output_item", kinds
    call = result.new_items[0].raw_item
    assert json.loads(call.arguments) == calls[0] and call.call_id.startswith("call_")
    assert len(result.raw_responses) == 2 and all(r.response_id.startswith("resp_") for r in result.raw_responses)
    assert result.raw_responses[1].usage.input_tokens > result.raw_responses[0].usage.input_tokens  # the tool's result went back
    srv.wait_idle()
