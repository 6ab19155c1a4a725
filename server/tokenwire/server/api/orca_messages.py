"""The two ORCA messages tokenwire speaks, defined in a descriptor pool of their own.

The wire names and field numbers are those of `xds.data.orca.v3.OrcaLoadReport` and
`xds.service.orca.v3.OrcaLoadReportRequest` (cncf/xds), so gRPC clients' `weighted_round_robin`
and any ORCA consumer read them. They are built here rather than imported from the
`xds-protos` distribution because that distribution also installs its own, older copy of the
`opentelemetry.proto` modules over opentelemetry-proto's, which breaks the OTLP exporter
(`cannot import name 'InstrumentationScope'`). A private pool also keeps these full names from
clashing with another copy of the same files loaded into the default pool.
"""

from __future__ import annotations

from typing import Any

from google.protobuf import descriptor_pb2, descriptor_pool, duration_pb2, message_factory

_FIELD = descriptor_pb2.FieldDescriptorProto

LOAD_REPORT_NAME = "xds.data.orca.v3.OrcaLoadReport"
REQUEST_NAME = "xds.service.orca.v3.OrcaLoadReportRequest"
SERVICE_NAME = "xds.service.orca.v3.OpenRcaService"


def _double_map(message: descriptor_pb2.DescriptorProto, full_name: str, name: str, number: int) -> None:
    """Adds `map<string, double> name = number;` to `message`, whose full name is `full_name`."""
    entry_name = "".join(part.capitalize() for part in name.split("_")) + "Entry"
    entry = message.nested_type.add(name=entry_name)
    entry.options.map_entry = True
    entry.field.add(name="key", number=1, type=_FIELD.TYPE_STRING, label=_FIELD.LABEL_OPTIONAL)
    entry.field.add(name="value", number=2, type=_FIELD.TYPE_DOUBLE, label=_FIELD.LABEL_OPTIONAL)
    message.field.add(
        name=name,
        number=number,
        type=_FIELD.TYPE_MESSAGE,
        label=_FIELD.LABEL_REPEATED,
        type_name=f".{full_name}.{entry_name}",
    )


def _load_report_file() -> descriptor_pb2.FileDescriptorProto:
    file = descriptor_pb2.FileDescriptorProto(
        name="xds/data/orca/v3/orca_load_report.proto", package="xds.data.orca.v3", syntax="proto3"
    )
    report = file.message_type.add(name="OrcaLoadReport")
    for name, number in (("cpu_utilization", 1), ("mem_utilization", 2)):
        report.field.add(name=name, number=number, type=_FIELD.TYPE_DOUBLE, label=_FIELD.LABEL_OPTIONAL)
    # Field 3 is the deprecated integer `rps`; tokenwire reports `rps_fractional` (6) instead.
    report.field.add(name="rps", number=3, type=_FIELD.TYPE_UINT64, label=_FIELD.LABEL_OPTIONAL)
    _double_map(report, LOAD_REPORT_NAME, "request_cost", 4)
    _double_map(report, LOAD_REPORT_NAME, "utilization", 5)
    for name, number in (("rps_fractional", 6), ("eps", 7)):
        report.field.add(name=name, number=number, type=_FIELD.TYPE_DOUBLE, label=_FIELD.LABEL_OPTIONAL)
    _double_map(report, LOAD_REPORT_NAME, "named_metrics", 8)
    report.field.add(
        name="application_utilization", number=9, type=_FIELD.TYPE_DOUBLE, label=_FIELD.LABEL_OPTIONAL
    )
    return file


def _service_file() -> descriptor_pb2.FileDescriptorProto:
    file = descriptor_pb2.FileDescriptorProto(
        name="xds/service/orca/v3/orca.proto",
        package="xds.service.orca.v3",
        syntax="proto3",
        dependency=["google/protobuf/duration.proto", "xds/data/orca/v3/orca_load_report.proto"],
    )
    request = file.message_type.add(name="OrcaLoadReportRequest")
    request.field.add(
        name="report_interval",
        number=1,
        type=_FIELD.TYPE_MESSAGE,
        label=_FIELD.LABEL_OPTIONAL,
        type_name=".google.protobuf.Duration",
    )
    request.field.add(
        name="request_cost_names", number=2, type=_FIELD.TYPE_STRING, label=_FIELD.LABEL_REPEATED
    )
    service = file.service.add(name="OpenRcaService")
    service.method.add(
        name="StreamCoreMetrics",
        input_type=f".{REQUEST_NAME}",
        output_type=f".{LOAD_REPORT_NAME}",
        server_streaming=True,
    )
    return file


def _build() -> tuple[Any, Any, Any]:
    pool = descriptor_pool.DescriptorPool()
    pool.AddSerializedFile(duration_pb2.DESCRIPTOR.serialized_pb)
    pool.Add(_load_report_file())
    pool.Add(_service_file())
    return (
        pool,
        message_factory.GetMessageClass(pool.FindMessageTypeByName(LOAD_REPORT_NAME)),
        message_factory.GetMessageClass(pool.FindMessageTypeByName(REQUEST_NAME)),
    )


POOL, OrcaLoadReport, OrcaLoadReportRequest = _build()
"""`POOL` holds the two ORCA files; server reflection describes the ORCA service from it."""
