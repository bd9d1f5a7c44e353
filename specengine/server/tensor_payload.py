"""Tensors sent in HTTP request bodies (TRL's ``/update_named_param/`` and the control routes'
``/update_weights``): JSON ``{"name", "dtype", "shape", "data"}`` with ``data`` the base64 of
the bytes, or a raw ``application/octet-stream`` body with ``name``, ``dtype`` and ``shape``
as query parameters; little-endian, C order. Shared by ``trl_routes`` and ``control_routes``.
"""

from __future__ import annotations

import base64
import binascii
import math

import torch
from fastapi import Request
from pydantic import ValidationError

from specengine.server.protocol import APIError, Strict, validation_error_body

WEIGHT_DTYPES = {"float32": torch.float32, "float": torch.float32, "float16": torch.float16,
                 "half": torch.float16, "bfloat16": torch.bfloat16, "float64": torch.float64,
                 "double": torch.float64}


class UpdateNamedParam(Strict):
    name: str
    dtype: str
    shape: list[int]
    data: str | None = None


def tensor_from_bytes(name: str, dtype: str, shape: list[int], data: bytes) -> torch.Tensor:
    """A tensor of ``dtype`` (``"bfloat16"`` or ``"torch.bfloat16"``, any float dtype) and
    ``shape`` from its little-endian C-order bytes.

    Raises:
        APIError: an unknown dtype, a negative dimension, or a byte count that does not match.
    """
    dt = WEIGHT_DTYPES.get(dtype.removeprefix("torch."))
    if dt is None:
        raise APIError(f"{name}: dtype {dtype!r} is not a float dtype; use one of "
                       f"{sorted(WEIGHT_DTYPES)}", param="dtype")
    if any(d < 0 for d in shape):
        raise APIError(f"{name}: shape {shape} has a negative dimension", param="shape")
    numel = math.prod(shape)
    itemsize = torch.empty((), dtype=dt).element_size()
    if len(data) != numel * itemsize:
        raise APIError(f"{name}: got {len(data)} bytes; shape {shape} of {dtype} needs "
                       f"{numel * itemsize}", param="data")
    if numel == 0:
        return torch.empty(shape, dtype=dt)
    return torch.frombuffer(bytearray(data), dtype=dt).reshape(shape)


async def read_named_tensor(request: Request) -> tuple[str, torch.Tensor]:
    """The ``(name, tensor)`` in a request body encoded as ``/update_named_param/`` takes it:
    JSON ``{"name", "dtype", "shape", "data"}`` (``data``: base64 of the bytes), or a raw
    ``application/octet-stream`` body with ``name``, ``dtype`` and ``shape`` (``2,3``) as query
    parameters; little-endian, C order.

    Raises:
        APIError: unknown or missing fields, bad base64, a dtype that is not a float dtype, a
            byte count that does not match the shape.
    """
    raw = await request.body()
    if request.headers.get("content-type", "").startswith("application/octet-stream"):
        q = dict(request.query_params)
        unknown = sorted(set(q) - {"name", "dtype", "shape"})
        if unknown:
            raise APIError(f"unknown query parameter(s) {unknown}", param=unknown[0])
        for key in ("name", "dtype", "shape"):
            if key not in q:
                raise APIError(f"query parameter {key!r} is required with a raw body",
                               param=key)
        try:
            shape = [int(x) for x in q["shape"].strip("[]() ").split(",") if x.strip()]
        except ValueError:
            raise APIError(f"shape={q['shape']!r} must be comma-separated integers",
                           param="shape") from None
        return q["name"], tensor_from_bytes(q["name"], q["dtype"], shape, raw)
    try:
        body = UpdateNamedParam.model_validate_json(raw)
    except ValidationError as e:
        err = validation_error_body(e.errors())["error"]
        raise APIError(err["message"], param=err["param"], code=err["code"]) from None
    return body.name, named_tensor(body)


def named_tensor(body: UpdateNamedParam) -> torch.Tensor:
    """The tensor of one JSON-encoded entry (``data`` in base64).

    Raises:
        APIError: no ``data``, bad base64, or as ``tensor_from_bytes``.
    """
    if body.data is None:
        raise APIError(f"{body.name}: this server has no NCCL communicator; send the "
                       "tensor's bytes in 'data' (base64) or as a raw "
                       "application/octet-stream body", param="data")
    try:
        data = base64.b64decode(body.data, validate=True)
    except (binascii.Error, ValueError):
        raise APIError(f"{body.name}: 'data' is not valid base64", param="data") from None
    return tensor_from_bytes(body.name, body.dtype, body.shape, data)
