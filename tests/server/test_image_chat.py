"""Images in chat completions: `image_url` content parts (OpenAI's and vLLM's bare-string form),
every refusal an OpenAI-style 400 that adds nothing to the engine, and (slow) the real server
through the `openai` client on a tiny LLaVA, streamed and not, its greedy text equal to
`LLM.chat` on the same messages."""

from __future__ import annotations

import base64
import io
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from openai_schemas import validate
from PIL import Image
from pydantic import ValidationError

from portside.engine.async_engine import AsyncLLMEngine
from portside.server.protocol import ChatCompletionRequest, TokenizeRequest, image_urls

MAX_TOKENS = 6
needs_engine = pytest.mark.skipif(not hasattr(AsyncLLMEngine, "process_multimodal"),
                                  reason="the engine's process_multimodal has not landed")


def data_url(color: tuple[int, int, int], size: tuple[int, int] = (30, 20), mode: str = "RGB") -> str:
    buf = io.BytesIO()
    Image.new(mode, size, color if mode == "RGB" else (*color, 255)).save(buf, "PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


RED, BLUE = data_url((200, 10, 10)), data_url((10, 10, 200), (40, 28))


def image_part(url: str, **extra: Any) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": url, **extra}}


def user(*parts: Any) -> dict[str, Any]:
    return {"role": "user", "content": [{"type": "text", "text": p} if isinstance(p, str) else p for p in parts]}


def chat(messages: list[dict[str, Any]], **fields: Any) -> dict[str, Any]:
    return {"model": "m", "messages": messages, "max_tokens": MAX_TOKENS, "temperature": 0, **fields}


# ---- protocol -------------------------------------------------------------------------------


def test_parts_become_template_parts_and_urls_in_order():
    req = ChatCompletionRequest.model_validate(chat([
        {"role": "system", "content": [{"type": "text", "text": "be brief"}]},
        user("compare ", image_part(RED, detail="low"), " and ", {"type": "image_url", "image_url": BLUE}),
        {"role": "assistant", "content": "ok"},
        user(image_part(BLUE)),
    ]))  # fmt: skip
    system, first, _, second = req.messages
    assert system.content == "be brief" and system.image_urls == []  # text-only content stays a string
    assert first.content == [{"type": "text", "text": "compare "}, {"type": "image"}, {"type": "text", "text": " and "},
                             {"type": "image"}]
    assert first.image_urls == [RED, BLUE] and second.content == [{"type": "image"}]
    assert image_urls(req.messages) == [RED, BLUE, BLUE]
    assert req.model_copy(deep=True).messages[1].image_urls == [RED, BLUE]


@pytest.mark.parametrize("message, needle", [
    ({"role": "system", "content": [image_part(RED)]}, "only accepted in user messages"),
    ({"role": "assistant", "content": [image_part(RED)]}, "only accepted in user messages"),
    ({"role": "tool", "tool_call_id": "c", "content": [image_part(RED)]}, "only accepted in user messages"),
    (user({"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}), "unsupported content part type 'input_audio'"),
    (user({"type": "image_url", "image_url": {"url": RED, "detail": "ultra"}}), "detail must be one of auto, low, high"),
    (user({"type": "image_url", "image_url": {"url": ""}}), "image_url.url must be a non-empty string"),
    (user({"type": "image_url", "image_url": {"uri": RED}}), "unexpected field image_url.uri"),
    (user({"type": "image_url", "image_url": 5}), "image_url must be an object"),
    (user({"type": "image_url"}), "image_url must be an object"),
    ({"role": "user", "content": ["not-a-part"]}, "a content part must be an object"),
])  # fmt: skip
def test_refused_parts(message: dict[str, Any], needle: str):
    with pytest.raises(ValidationError) as info:
        ChatCompletionRequest.model_validate(chat([message]))
    assert needle in str(info.value)


def test_tokenize_refuses_images():
    with pytest.raises(ValidationError, match="image parts are accepted by /v1/chat/completions only"):
        TokenizeRequest.model_validate({"messages": [user("hi", image_part(RED))]})


# ---- the server in process ------------------------------------------------------------------


def _error(r: Any, status: int = 400) -> dict[str, Any]:
    assert r.status_code == status, r.text
    validate("ErrorResponse", r.json())
    return r.json()["error"]


@pytest.fixture(scope="module")
def text_client(tiny_llama: Path) -> Iterator[Any]:
    from fastapi.testclient import TestClient

    from portside.engine.llm_engine import LLMEngine
    from portside.server.app import ServerConfig, build_app

    engine = LLMEngine.from_args(model=str(tiny_llama), device="cpu", num_kv_blocks=64, max_model_len=256)
    with TestClient(build_app(engine, ServerConfig(served_model_names=["m"]))) as client:
        yield client


def test_text_only_model_refuses_images(text_client: Any):
    err = _error(text_client.post("/v1/chat/completions", json=chat([user("what is it?", image_part(RED))])))
    assert "does not take images" in err["message"] and err["param"] == "messages[0].content"
    err = _error(text_client.post("/v1/chat/completions", json=chat([{"role": "system", "content": [image_part(RED)]},
                                                                       user("hi")])))
    assert "only accepted in user messages" in err["message"] and err["param"].startswith("messages[0].content")
    err = _error(text_client.post("/v1/chat/completions", json=chat([user({"type": "video_url", "video_url": {"url": "x"}})])))
    assert "unsupported content part type 'video_url'" in err["message"]
    # text parts alone are still one string, as before
    r = text_client.post("/v1/chat/completions", json=chat([user("hello ", "there")]))
    assert r.status_code == 200, r.text


@pytest.fixture(scope="module")
def llava(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from portside.testing.tiny_llava import make_tiny_llava

    return make_tiny_llava(tmp_path_factory.mktemp("tiny_llava"))


@pytest.fixture(scope="module")
def media_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("media")
    Image.new("RGB", (24, 24), (10, 200, 10)).save(folder / "green.png")
    Image.new("RGBA", (24, 24), (0, 0, 0, 0)).save(folder / "clear.png")
    return folder


@pytest.fixture(scope="module")
def vlm(llava: Path, media_dir: Path) -> Iterator[tuple[Any, Any]]:
    """(TestClient, LLMEngine) of a tiny LLaVA allowing 2 images a prompt and files under media_dir."""
    from fastapi.testclient import TestClient

    from portside.engine.llm_engine import LLMEngine
    from portside.multimodal.media import MediaConnector
    from portside.server.app import ServerConfig, build_app

    engine = LLMEngine.from_args(model=str(llava), device="cpu", num_kv_blocks=128, max_model_len=512,
                                 limit_mm_per_prompt={"image": 2})
    config = ServerConfig(served_model_names=["m"], media=MediaConnector(allowed_local_media_path=str(media_dir)))
    with TestClient(build_app(engine, config)) as client:
        yield client, engine


@needs_engine
@pytest.mark.parametrize("parts, param, needle", [
    ([image_part("data:image/png;base64," + base64.b64encode(b"not a png").decode())], "messages[0].content[1]", "not an image"),
    ([image_part("data:image/png;base64,%%%")], "messages[0].content[1]", "invalid base64"),
    ([image_part(RED), image_part("https://example.com/cat.png")], "messages[0].content[2]", "remote image URLs are not allowed"),
    ([image_part("file:///etc/passwd")], "messages[0].content[1]", "outside the folder"),
    ([image_part(RED), image_part(BLUE), image_part(RED)], "messages[0].content[3]", "3 images in one request, more than the 2"),
])  # fmt: skip
def test_bad_images_are_400s_and_add_nothing(vlm: tuple[Any, Any], parts: list[Any], param: str, needle: str):
    client, engine = vlm
    err = _error(client.post("/v1/chat/completions", json=chat([user("look", *parts)])))
    assert needle in err["message"] and err["param"] == param, err
    assert not engine.has_unfinished_requests() and not client.app.state.engine.num_waiting


@needs_engine
def test_image_chat_in_process(vlm: tuple[Any, Any], media_dir: Path):
    client, engine = vlm
    body = chat([user("what is this?", image_part(RED))])
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    validate("CreateChatCompletionResponse", r.json())
    text_only = client.post("/v1/chat/completions", json=chat([user("what is this?")])).json()
    # the placeholder expanded to the image's embedding rows
    assert r.json()["usage"]["prompt_tokens"] > text_only["usage"]["prompt_tokens"] + 1
    # a local file, the bare-string form, and transparency: all load
    r = client.post("/v1/chat/completions", json=chat([user({"type": "image_url", "image_url": f"file://{media_dir}/clear.png"},
                                                            "and", image_part(f"file://{media_dir}/green.png"))]))
    assert r.status_code == 200, r.text
    # beam search carries the images in every beam's request
    r = client.post("/v1/chat/completions", json=chat([user("x", image_part(RED))], use_beam_search=True, n=2, max_tokens=4))
    assert r.status_code == 200, r.text
    validate("CreateChatCompletionResponse", r.json())
    assert len(r.json()["choices"]) == 2
    # the tokenize endpoint does not take images
    assert _error(client.post("/tokenize", json={"messages": [user("x", image_part(RED))]}))
    assert not engine.has_unfinished_requests()


def test_limit_mm_per_prompt_and_media_flags(capsys: pytest.CaptureFixture[str], tmp_path: Path):
    from portside.cli import build_parser, parse_args
    from portside.engine.args import EngineArgs
    from portside.server.main import server_config

    def usage_error(*argv: str) -> str:
        with pytest.raises(SystemExit) as e:
            parse_args(build_parser(), ["serve", *argv])
        assert e.value.code == 2
        return capsys.readouterr().err

    assert "unknown modality 'video'; supported: image" in usage_error("--limit-mm-per-prompt", '{"video": 1}')
    assert "not valid JSON" in usage_error("--limit-mm-per-prompt", '{"image": 2')
    assert "'image' must be a count of at least 0" in usage_error("--limit-mm-per-prompt", '{"image": -1}')
    args = parse_args(build_parser(), ["serve", "--limit-mm-per-prompt", '{"image": 2}', "--allowed-media-domains", "a.example",
                                       "b.example", "--allowed-local-media-path", str(tmp_path), "--media-max-bytes", "1000"])
    assert args.limit_mm_per_prompt == {"image": 2}
    media = server_config(args).media
    assert media.allowed_media_domains == ("a.example", "b.example") and media.max_bytes == 1000
    assert media.allowed_local_media_path == str(tmp_path.resolve())
    for argv, needle in ((["--media-max-bytes", "0"], "--media-max-bytes must be"),
                         (["--media-fetch-timeout", "-1"], "--media-fetch-timeout must be"),
                         (["--allowed-local-media-path", str(tmp_path / "nope")], "is not a folder"),
                         (["--allowed-media-domains", "https://x.example/"], "--allowed-media-domains: ")):
        with pytest.raises(ValueError, match=needle):
            server_config(parse_args(build_parser(), ["serve", *argv]))
    assert EngineArgs(limit_mm_per_prompt="image=0")._resolve_multimodal().limit("image") == 0
    with pytest.raises(ValueError, match="limit_mm_per_prompt: unknown modality 'video'"):
        EngineArgs(limit_mm_per_prompt={"video": 1})._resolve_multimodal()


def test_generate_checks_multi_modal_data(tiny_llama: Path):
    from portside.engine.llm import _check_multi_modal_data

    img = Image.new("RGB", (2, 2))
    _check_multi_modal_data(0, {"image": img})
    _check_multi_modal_data(0, {"image": [img, img]})
    for bad, needle in (({"image": "x.png"}, "is a str"), ({"video": img}, "must be"), ({"image": []}, "empty list"),
                        ([img], "must be")):
        with pytest.raises(ValueError, match=needle):
            _check_multi_modal_data(0, bad)


# ---- end to end: the real server and the openai client --------------------------------------


def _messages(media_dir: Path) -> list[dict[str, Any]]:
    return [
        {"role": "system", "content": "You describe images."},
        user("what is in ", image_part(RED), " and in ", image_part(f"file://{media_dir}/green.png"), "?"),
    ]


@needs_engine
@pytest.mark.slow
def test_openai_client_end_to_end_equals_offline_chat(llava: Path, media_dir: Path, tmp_path: Path):
    import openai
    from helpers import sse_events
    from server_process import ServerProcess

    from portside import LLM, SamplingParams

    messages = _messages(media_dir)
    with LLM(model=str(llava), device="cpu", dtype="float32", max_model_len=512, allowed_local_media_path=str(media_dir)) as llm:
        offline = llm.chat(messages, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True), use_tqdm=False)
    expected = offline[0].outputs[0].text
    assert len(offline[0].outputs[0].token_ids) == MAX_TOKENS

    proc = ServerProcess(llava, tmp_path / "server.log", "--max-model-len", "512", "--limit-mm-per-prompt", '{"image": 2}',
                         "--allowed-local-media-path", str(media_dir), api_key="sk-test")
    try:
        proc.wait_ready()
        client = openai.OpenAI(base_url=proc.url + "/v1", api_key="sk-test", max_retries=0, timeout=120)
        fields = dict(model="tiny", messages=messages, temperature=0, max_tokens=MAX_TOKENS, extra_body={"ignore_eos": True})
        raw = client.chat.completions.with_raw_response.create(**fields)
        validate("CreateChatCompletionResponse", raw.http_response.json())
        completion = raw.parse()
        assert completion.choices[0].message.content == expected
        assert completion.usage.prompt_tokens == len(offline[0].prompt_token_ids)

        stream = client.chat.completions.create(**fields, stream=True, stream_options={"include_usage": True})
        chunks = list(stream)
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected
        assert chunks[-1].usage.completion_tokens == MAX_TOKENS
        events = sse_events(proc, "/v1/chat/completions", {**{k: v for k, v in fields.items() if k != "extra_body"},
                                                           "ignore_eos": True, "stream": True})
        for event in events:
            validate("CreateChatCompletionStreamResponse", event)
        assert "".join(e["choices"][0]["delta"].get("content") or "" for e in events if e["choices"]) == expected

        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(model="tiny", messages=[user("x", image_part(RED), image_part(RED), image_part(RED))])
        assert "more than the 2" in str(info.value)
        assert proc.wait_idle()
    finally:
        proc.kill()
