"""The per-call ORCA load report, `endpoint-load-metrics-bin`, read with buf curl.

gRPC's own C-core client keeps this trailer for its load balancers and never shows it to Python
code; buf curl prints every trailer it receives (`-v`), so it shows what goes on the wire.
"""

from __future__ import annotations

import base64
import json
import re

from google.protobuf.message import Message

from tests.interop.test_buf_curl import SERVICE, buf_curl
from tokenwire.server.api.orca import TRAILER
from tokenwire.server.api.orca_messages import OrcaLoadReport
from tokenwire.server.app import TokenwireServer


def load_reports(verbose_output: str) -> list[Message]:
    """Every load report trailer in buf curl's -v output (binary values come base64, unpadded)."""
    values = re.findall(rf"{re.escape(TRAILER)}: (\S+)", verbose_output, flags=re.IGNORECASE)
    return [OrcaLoadReport.FromString(base64.b64decode(v + "=" * (-len(v) % 4))) for v in values]


async def test_generate_ends_with_a_load_report_trailer(server: TokenwireServer) -> None:
    url = f"http://127.0.0.1:{server.port}/{SERVICE}/Generate"
    body = json.dumps({"prompt": "Hi", "stopping": {"maxNewTokens": 3, "ignoreEos": True}})
    code, _, err = await buf_curl(server.port, "-v", "-d", body, url)
    assert code == 0, err
    (report,) = load_reports(err)
    assert set(report.named_metrics) == {"queue_depth", "running", "kv_cache_utilization"}
    assert report.rps_fractional > 0.0  # the call's own generation finished before the trailer


async def test_stream_generate_ends_with_a_load_report_trailer(server: TokenwireServer) -> None:
    line = json.dumps(
        {"generate": {"requestId": "a", "prompt": "Hi", "stopping": {"maxNewTokens": 3, "ignoreEos": True}}}
    )
    url = f"http://127.0.0.1:{server.port}/{SERVICE}/StreamGenerate"
    code, _, err = await buf_curl(server.port, "-v", "-d", "@-", url, stdin=line)
    assert code == 0, err
    (report,) = load_reports(err)
    assert report.rps_fractional > 0.0  # the stream's own generation finished before the trailer
    assert "queue_depth" in report.named_metrics


async def test_a_refused_call_keeps_its_error_details_instead(server: TokenwireServer) -> None:
    url = f"http://127.0.0.1:{server.port}/{SERVICE}/Generate"
    code, _, err = await buf_curl(server.port, "-v", "-d", json.dumps({"prompt": ""}), url)
    assert code != 0
    assert load_reports(err) == []
    assert "Grpc-Status-Details-Bin" in err
