"""Registration of the kvcm.v1 services with request decoders that never raise.

grpc's generated ``add_*Servicer_to_server`` decode with ``Message.FromString``: bytes that
are not the request message make grpc answer UNKNOWN and log an ERROR traceback per call,
outside every interceptor. Here each method decodes through :func:`decode_or_mark`, which
answers an :class:`UndecodableRequest` marker instead, which the innermost wrapper turns into
INVALID_ARGUMENT (counted like any rejected call) after the interceptors have authenticated
the caller, so the servicers only ever see messages.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any, Final

import grpc
from google.protobuf.message import DecodeError  # type: ignore[import-untyped]
from google.protobuf.message_factory import GetMessageClass  # type: ignore[import-untyped]

from kvcm.common.errors import InvalidArgumentError
from kvcm.v1 import service_pb2

__all__ = ["UndecodableRequest", "decode_or_mark", "register_services"]

_SERVICES: Final = service_pb2.DESCRIPTOR.services_by_name


class UndecodableRequest:
    """Stands for request bytes that are not a valid ``type_name`` message."""

    __slots__ = ("type_name",)

    def __init__(self, type_name: str) -> None:
        """Mark a request that failed to decode as ``type_name``."""
        self.type_name = type_name

    def error(self) -> InvalidArgumentError:
        """The error the call ends with (INVALID_ARGUMENT)."""
        return InvalidArgumentError(f"request is not a valid {self.type_name}", field="request")


def decode_or_mark(message_class: Any) -> Callable[[bytes], Any]:
    """A request deserializer for ``message_class`` that answers a marker on bad bytes."""
    type_name = message_class.DESCRIPTOR.full_name
    from_string = message_class.FromString

    def decode(data: bytes) -> Any:
        try:
            return from_string(data)
        except DecodeError:
            return UndecodableRequest(type_name)

    return decode


def _refuse_marker(behavior: Any) -> Any:
    """``behavior`` ending a call whose request did not decode with INVALID_ARGUMENT.

    Raised here, innermost, rather than by the first interceptor, so that authentication
    (which reads only metadata) answers an anonymous caller's bad bytes first.
    """

    async def call(request: Any, context: Any) -> Any:
        if type(request) is UndecodableRequest:
            raise request.error()
        return await behavior(request, context)

    return call


def _refuse_marker_stream(behavior: Any) -> Any:
    """:func:`_refuse_marker` for a server-streaming ``behavior``."""

    async def call(request: Any, context: Any) -> AsyncIterator[Any]:
        if type(request) is UndecodableRequest:
            raise request.error()
        async for item in behavior(request, context):
            yield item

    return call


def _serialize(message: Any) -> bytes:
    data: bytes = message.SerializeToString()
    return data


def register_services(server: grpc.aio.Server, servicers: dict[str, object]) -> None:
    """Register each kvcm.v1 service's methods on ``server``.

    Args:
        server: The server.
        servicers: Servicer per service name (``"AdminService"``); every method of the
            service must exist on it.
    """
    for name, servicer in servicers.items():
        service = _SERVICES[name]
        handlers: dict[str, grpc.RpcMethodHandler] = {}
        for method in service.methods:
            behavior = getattr(servicer, method.name)
            decode = decode_or_mark(GetMessageClass(method.input_type))
            if method.client_streaming:  # the servicer reads the marker among the chunks
                make = grpc.stream_unary_rpc_method_handler
            elif method.server_streaming:
                make = grpc.unary_stream_rpc_method_handler
                behavior = _refuse_marker_stream(behavior)
            else:
                make = grpc.unary_unary_rpc_method_handler
                behavior = _refuse_marker(behavior)
            handlers[method.name] = make(
                behavior, request_deserializer=decode, response_serializer=_serialize
            )
        server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler(service.full_name, handlers),)
        )
