"""The values a job file's key may hold, each with the message its mistake gets.

``jobfile.py`` declares the keys with these types; a mistake's message says what was expected
and what the file held (``expected an integer >= 1, got 'ten'``), and ``specload`` puts the
file, the line and the key in front of it.
"""
import re
from typing import Annotated, Any, Literal, Optional

from annotated_types import Ge, Gt
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, model_validator
from pydantic_core import InitErrorDetails, PydanticCustomError

FACTORY_RE = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")
TARGET = "'module:function' (e.g. my_job:build_model)"


def mistake(expected: str, value: Any) -> PydanticCustomError:
    """A validation error in our words: what was expected, and what the file held."""
    return PydanticCustomError("job_file", "{expected}", {"expected": f"{expected}, got {value!r}"})


def _checked(ok, expected: str, convert=lambda v: v, optional: bool = False):
    def check(v):
        if optional and v is None:
            return v
        if not ok(v):
            raise mistake(expected, v)
        return convert(v)
    return BeforeValidator(check)


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def Integer(minimum: int | None = None, optional: bool = False):
    t = int if minimum is None else Annotated[int, Ge(minimum)]
    return Annotated[Optional[t] if optional else t, _checked(
        lambda v: _is_int(v) and (minimum is None or v >= minimum),
        "expected an integer" + ("" if minimum is None else f" >= {minimum}"), optional=optional)]


def Number(minimum: float, optional: bool = False, above: bool = False):
    t = Annotated[float, Gt(minimum) if above else Ge(minimum)]
    expected = "expected a positive number" if above and minimum == 0 else (
        f"expected a number {'>' if above else '>='} {minimum}")
    return Annotated[Optional[t] if optional else t, _checked(
        lambda v: _is_number(v) and (v > minimum if above else v >= minimum), expected, float,
        optional)]


def Choice(values: tuple, optional: bool = False):
    t = Literal[values]
    return Annotated[Optional[t] if optional else t, _checked(
        lambda v: isinstance(v, str) and v in values, f"expected one of {', '.join(values)}",
        optional=optional)]


def _text(expected: str, ok=lambda v: True, optional: bool = False, pattern: str | None = None):
    t = Annotated[str, Field(min_length=1, pattern=pattern)]
    return Annotated[Optional[t] if optional else t, _checked(
        lambda v: isinstance(v, str) and bool(v.strip()) and ok(v), expected, optional=optional)]


Text = _text("expected a non-empty string")
OptionalText = _text("expected a non-empty string", optional=True)
Boolean = Annotated[bool, _checked(lambda v: isinstance(v, bool), "expected true or false")]
Target = _text(f"expected {TARGET}", FACTORY_RE.match, pattern=FACTORY_RE.pattern)
Strings = Annotated[tuple[str, ...], _checked(
    lambda v: isinstance(v, list) and all(isinstance(x, str) and x for x in v),
    "expected a list of strings", tuple)]
Keywords = Annotated[dict[str, Any], _checked(
    lambda v: v is None or isinstance(v, dict), "expected a mapping of keyword arguments",
    lambda v: dict(v or {}))]
Sha256 = _text("expected 64 hexadecimal digits (a sha256)",
               lambda v: re.fullmatch(r"[0-9a-f]{64}", v), pattern="^[0-9a-f]{64}$")


class Section(BaseModel):
    """A mapping of the job file: only its own keys, each of its own type."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    @model_validator(mode="wrap")
    @classmethod
    def _name_the_keys(cls, data, handler):
        """An unknown key's message lists the keys this section allows."""
        try:
            return handler(data)
        except ValidationError as exc:
            allowed = ", ".join(sorted(cls.model_fields))
            raise ValidationError.from_exception_data(exc.title, [InitErrorDetails(
                type=PydanticCustomError(
                    "unknown_key", "unknown key; expected one of: {allowed}", {"allowed": allowed})
                if e["type"] == "extra_forbidden" and len(e["loc"]) == 1 else
                PydanticCustomError(e["type"], "{msg}", {"msg": e["msg"]}),
                loc=e["loc"], input=e["input"]) for e in exc.errors()]) from None


def _form(kinds, expected: str, ok=lambda v: True, optional: bool = False, convert=lambda v: v):
    return _checked(lambda v: isinstance(v, kinds) and ok(v), expected, convert, optional)
