"""Optional OpenTelemetry tracing (`--otlp-traces-endpoint URL`): one span per ended request.

The span is vLLM's: named `llm_request`, kind SERVER, from the request's arrival to its end,
with the `gen_ai.*` request, usage and latency attributes vLLM sets. Spans are exported over
OTLP, by gRPC unless `OTEL_EXPORTER_OTLP_TRACES_PROTOCOL=http/protobuf`, in batches off the
event loop. Needs the `otel` extra (opentelemetry-sdk and opentelemetry-exporter-otlp).
"""

from __future__ import annotations

import os
import time
from typing import Any

from portside.engine.stats import RequestRecord

INSTALL_HINT = "pip install opentelemetry-sdk opentelemetry-exporter-otlp"
SPAN_NAME = "llm_request"


def check_available() -> None:
    """Raise ValueError naming the install command unless the SDK and the OTLP exporter import."""
    try:
        import opentelemetry.exporter.otlp.proto.grpc.trace_exporter  # noqa: F401
        import opentelemetry.sdk.trace  # noqa: F401
    except ImportError as e:
        raise ValueError(f"--otlp-traces-endpoint needs OpenTelemetry ({e.name} is missing): {INSTALL_HINT}") from None


def otlp_exporter(endpoint: str) -> Any:
    protocol = os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "grpc")
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    elif protocol == "http/protobuf":
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter  # type: ignore[assignment]
    else:
        raise ValueError(f"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL={protocol!r}: use grpc or http/protobuf")
    return OTLPSpanExporter(endpoint=endpoint)


class RequestTracer:
    """`on_request_done` callback: a span per ended request, to `exporter` (default: OTLP to `endpoint`)."""

    def __init__(self, model: str, endpoint: str | None = None, exporter: Any = None) -> None:
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor

        if exporter is None:
            if not endpoint:
                raise ValueError("RequestTracer needs an OTLP endpoint or a span exporter")
            exporter = otlp_exporter(endpoint)
        self.model = model
        self.provider = TracerProvider(resource=Resource.create({"service.name": "portside"}))
        self.provider.add_span_processor(BatchSpanProcessor(exporter))
        self.tracer = self.provider.get_tracer("portside.server")

    def __call__(self, record: RequestRecord) -> None:
        from opentelemetry.trace import SpanKind, Status, StatusCode

        to_wall = time.time_ns() - time.monotonic_ns()  # spans carry wall-clock times; records, monotonic ones
        span = self.tracer.start_span(SPAN_NAME, kind=SpanKind.SERVER, start_time=to_wall + int(record.arrival_time * 1e9))
        params = record.params
        attributes: dict[str, Any] = {
            "gen_ai.response.model": record.lora_name or self.model,
            "gen_ai.request.id": record.request_id,
            "gen_ai.usage.prompt_tokens": record.num_prompt_tokens,
            "gen_ai.usage.completion_tokens": record.num_generation_tokens,
            "gen_ai.latency.e2e": record.e2e,
            "gen_ai.latency.time_in_queue": record.queue_time,
            "gen_ai.latency.time_to_first_token": record.ttft,
            "gen_ai.latency.time_in_model_prefill": record.prefill_time,
            "gen_ai.latency.time_in_model_decode": record.decode_time,
            "portside.finish_reason": record.outcome,
        }
        if record.prefill_time is not None and record.decode_time is not None:
            attributes["gen_ai.latency.time_in_model_inference"] = record.prefill_time + record.decode_time
        if params is not None:
            attributes.update({
                "gen_ai.request.temperature": params.temperature, "gen_ai.request.top_p": params.top_p,
                "gen_ai.request.max_tokens": params.max_tokens, "gen_ai.request.n": params.n,
                "gen_ai.usage.num_sequences": params.n,
            })  # fmt: skip
        span.set_attributes({k: v for k, v in attributes.items() if v is not None})
        if record.outcome == "error":
            span.set_status(Status(StatusCode.ERROR, "the engine failed"))
        span.end(end_time=to_wall + int(record.finish_time * 1e9))

    def shutdown(self) -> None:
        """Export what is pending and stop."""
        self.provider.shutdown()
