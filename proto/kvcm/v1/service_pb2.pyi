from kvcm.v1 import admin_pb2 as _admin_pb2
from kvcm.v1 import events_pb2 as _events_pb2
from kvcm.v1 import lookup_pb2 as _lookup_pb2
from kvcm.v1 import pd_pb2 as _pd_pb2
from kvcm.v1 import scheduler_pb2 as _scheduler_pb2
from kvcm.v1 import worker_pb2 as _worker_pb2
from google.protobuf import descriptor as _descriptor
from typing import ClassVar as _ClassVar

DESCRIPTOR: _descriptor.FileDescriptor
