"""Tool schemas come from signatures and docstrings; the model's arguments are checked against them."""

from __future__ import annotations

import enum
from typing import Annotated, Literal

import msgspec
import pytest

from slime_async.env import Env, Injected, ToolArgumentError, tool
from slime_async.types import Task


class Unit(enum.Enum):
    C = "celsius"
    F = "fahrenheit"


class Weather(Env):
    @tool
    async def forecast(
        self,
        city: Annotated[str, "the city's name"],
        days: Annotated[int, msgspec.Meta(ge=1, le=7)] = 1,
        unit: Unit = Unit.C,
        detail: Literal["low", "high"] = "low",
        tags: list[str] | None = None,
        task: Annotated[Task, Injected] = None,  # type: ignore[assignment]
    ) -> str:
        """Forecast the weather.

        Longer explanation for the model.

        Args:
            days: how many days ahead
            detail: how much to say
        """
        return f"{city} {days} {unit.value} {detail} {tags} {task.id}"

    @tool(name="ping", hidden=("session",))
    def ping_tool(self, session: str) -> str:
        """Check the connection."""
        return session


def test_schema_from_signature_and_docstring() -> None:
    schema = Weather.tools["forecast"].schema
    assert schema["type"] == "function"
    fn = schema["function"]
    assert fn["name"] == "forecast"
    assert fn["description"] == "Forecast the weather.\n\nLonger explanation for the model."
    params = fn["parameters"]
    assert params["type"] == "object"
    assert params["required"] == ["city"]
    assert params["additionalProperties"] is False
    props = params["properties"]
    assert set(props) == {"city", "days", "unit", "detail", "tags"}  # `task` is injected: hidden
    assert props["city"] == {"type": "string", "description": "the city's name"}
    assert props["days"] == {
        "type": "integer",
        "minimum": 1,
        "maximum": 7,
        "default": 1,
        "description": "how many days ahead",
    }
    assert sorted(props["detail"]["enum"]) == ["high", "low"]
    assert props["detail"]["description"] == "how much to say"
    assert props["tags"]["anyOf"] == [{"type": "array", "items": {"type": "string"}}, {"type": "null"}]
    assert props["unit"]["$ref"] == "#/$defs/Unit"
    assert params["$defs"]["Unit"]["enum"] == ["celsius", "fahrenheit"]


def test_hidden_by_name_and_renamed_tool() -> None:
    spec = Weather.tools["ping"]
    assert spec.parameters["properties"] == {}
    assert spec.hidden == {"session"}


def test_validation_accepts_good_and_fills_defaults() -> None:
    args = Weather.tools["forecast"].validate({"city": "Oslo", "unit": "fahrenheit"})
    assert args == {"city": "Oslo", "days": 1, "unit": Unit.F, "detail": "low", "tags": None}


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ({}, "missing required field `city`"),
        ({"city": 3}, "Expected `str`, got `int` - at `$.city`"),
        ({"city": "x", "days": "2"}, "Expected `int`, got `str` - at `$.days`"),
        ({"city": "x", "days": 9}, "Expected `int` <= 7 - at `$.days`"),
        ({"city": "x", "detail": "medium"}, "Invalid enum value 'medium' - at `$.detail`"),
        ({"city": "x", "task": "forged"}, "unknown field `task`"),  # injected args cannot be set by the model
        ({"city": "x", "nope": 1}, "unknown field `nope`"),
        (["Oslo"], "arguments must be a JSON object"),
    ],
)
def test_validation_rejects_bad_arguments(arguments: object, message: str) -> None:
    with pytest.raises(ToolArgumentError, match=message.replace("$", r"\$").replace("(", r"\(")):
        Weather.tools["forecast"].validate(arguments)


def test_declaration_errors_name_the_place() -> None:
    with pytest.raises(TypeError, match=r"NoHint\.f: parameter 'x' has no type hint"):

        class NoHint(Env):
            @tool
            def f(self, x) -> str:  # type: ignore[no-untyped-def]
                return ""

    with pytest.raises(TypeError, match=r"hidden=\['nope'\] are not arguments"):

        class BadHidden(Env):
            @tool(hidden=("nope",))
            def f(self, x: int) -> str:
                return ""
