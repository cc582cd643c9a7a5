"""``bench vllm-diff`` requests for structured outputs and tool calls (both
servers run with ``--enable-auto-tool-choice --tool-call-parser hermes``)."""
from __future__ import annotations

from typing import Any

from benchmarks.vllm_diff_corpus import CHAT, CMPL, Case, g, user

CITY = {"type": "object", "properties": {"name": {"type": "string"}, "country": {"type": "string"},
                                         "population": {"type": "integer"}},
        "required": ["name", "country", "population"]}
COLORS = {"type": "object", "properties": {"colors": {"type": "array", "items": {"type": "string"},
                                                      "minItems": 1, "maxItems": 3}}, "required": ["colors"]}
MOOD = {"type": "object", "properties": {"mood": {"enum": ["happy", "sad", "angry"]}}, "required": ["mood"]}
OPEN = {"type": "object", "properties": {"answer": {"type": "string"}}}  # additional properties not forbidden




def _rf(name: str, schema: dict[str, Any], strict: bool | None = None) -> dict[str, Any]:
    js: dict[str, Any] = {"name": name, "schema": schema}
    if strict is not None:
        js["strict"] = strict
    return {"type": "json_schema", "json_schema": js}


def structured_cases() -> list[Case]:
    city_q = user("Describe Paris as JSON with name, country and population.")
    n = 48
    return [
        Case("so-rf-city", "structured", CHAT, g(messages=city_q, max_tokens=n, response_format=_rf("City", CITY))),
        Case("so-rf-city-strict", "structured", CHAT, g(messages=city_q, max_tokens=n,
                                                        response_format=_rf("City", CITY, True))),
        Case("so-rf-colors", "structured", CHAT, g(messages=user("Give me colors as JSON."), max_tokens=n,
                                                   response_format=_rf("Colors", COLORS))),
        Case("so-rf-mood", "structured", CHAT, g(messages=user("How do you feel? JSON."), max_tokens=n,
                                                 response_format=_rf("Mood", MOOD))),
        Case("so-rf-open", "structured", CHAT, g(messages=user("Answer in JSON: what is 2+2?"), max_tokens=n,
                                                 response_format=_rf("Open", OPEN))),
        Case("so-rf-json-object", "structured", CHAT, g(messages=user("Give a JSON object about a cat."),
                                                        max_tokens=n, response_format={"type": "json_object"})),
        Case("so-rf-json-object-2", "structured", CHAT, g(messages=city_q, max_tokens=n,
                                                          response_format={"type": "json_object"})),
        Case("so-rf-text", "structured", CHAT, g(messages=user("Say hi."), max_tokens=8,
                                                 response_format={"type": "text"})),
        Case("so-cmpl-rf-json", "structured", CMPL, g(prompt="A JSON object describing Paris:", max_tokens=n,
                                                      response_format=_rf("City", CITY))),
        Case("so-cmpl-json", "structured", CMPL, g(prompt="Paris as JSON:", max_tokens=n,
                                                   structured_outputs={"json": CITY})),
        Case("so-cmpl-json-mood", "structured", CMPL, g(prompt="My mood as JSON:", max_tokens=n,
                                                        structured_outputs={"json": MOOD})),
        Case("so-chat-json", "structured", CHAT, g(messages=city_q, max_tokens=n, structured_outputs={"json": CITY})),
        Case("so-cmpl-regex-phone", "structured", CMPL, g(prompt="Call me at", max_tokens=20,
                                                          structured_outputs={"regex": r" \d{3}-\d{4}"})),
        Case("so-cmpl-regex-word", "structured", CMPL, g(prompt="The color of the sky is", max_tokens=10,
                                                         structured_outputs={"regex": r" (blue|grey|red)\."})),
        Case("so-cmpl-regex-date", "structured", CMPL, g(prompt="Today's date:", max_tokens=20,
                                                         structured_outputs={"regex": r" 20\d\d-[01]\d-[0-3]\d"})),
        Case("so-chat-regex", "structured", CHAT, g(messages=user("Pick a number."), max_tokens=10,
                                                    structured_outputs={"regex": r"[0-9]{1,3}"})),
        Case("so-cmpl-choice", "structured", CMPL, g(prompt="Is the sky blue? Answer:", max_tokens=6,
                                                     structured_outputs={"choice": [" yes", " no"]})),
        Case("so-cmpl-choice-3", "structured", CMPL, g(prompt="Best pet:", max_tokens=6,
                                                       structured_outputs={"choice": [" cat", " dog", " fish"]})),
        Case("so-chat-choice", "structured", CHAT, g(messages=user("Is fire hot?"), max_tokens=6,
                                                     structured_outputs={"choice": ["yes", "no"]})),
        Case("so-chat-choice-stream", "structured", CHAT, g(messages=user("Is ice cold?"), max_tokens=6, stream=True,
                                                            structured_outputs={"choice": ["yes", "no"]})),
        Case("so-cmpl-grammar", "structured", CMPL, g(prompt="A greeting:", max_tokens=10, structured_outputs={
            "grammar": 'root ::= " " ("hello" | "hi") " " ("world" | "there")'})),
        Case("so-chat-json-stream", "structured", CHAT, g(messages=city_q, max_tokens=n, stream=True,
                                                          response_format=_rf("City", CITY))),
        Case("so-no-ws", "structured", CHAT, g(messages=city_q, max_tokens=n, structured_outputs={
            "json": CITY, "disable_any_whitespace": True})),
        Case("so-no-extra-props", "structured", CHAT, g(messages=user("Answer in JSON: what is 2+2?"), max_tokens=n,
                                                        structured_outputs={"json": OPEN,
                                                                            "disable_additional_properties": True})),
        # The older guided_* fields: vLLM 0.32 dropped them (an unknown field, ignored), so free text there
        # (a difference docs/api.md lists, as the per-request disable_any_whitespace of so-no-ws).
        Case("so-guided-json", "structured", CMPL, g(prompt="Paris as JSON:", max_tokens=24, guided_json=CITY)),
        Case("so-guided-choice", "structured", CMPL, g(prompt="Is the sky blue? Answer:", max_tokens=6,
                                                       guided_choice=[" yes", " no"])),
    ]


def _fn(name: str, desc: str, props: dict[str, Any], required: list[str]) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, "description": desc, "parameters": {
        "type": "object", "properties": props, "required": required}}}


TOOLS = [_fn("get_weather", "Current weather in a city", {"city": {"type": "string"},
                                                          "unit": {"enum": ["celsius", "fahrenheit"]}}, ["city"]),
         _fn("get_time", "Current time in a timezone", {"timezone": {"type": "string"}}, ["timezone"])]
# The model's chat template ignores `tools`, so the auto prompts spell hermes' format out.
HERMES_SYS = ("You can call functions. To call one, answer only with <tool_call>{\"name\": NAME, \"arguments\": "
              "ARGS}</tool_call>. Functions: get_weather(city, unit), get_time(timezone).")


def _auto(text: str) -> list[dict[str, Any]]:
    return [{"role": "system", "content": HERMES_SYS}, *user(text)]


def tool_cases() -> list[Case]:
    weather = user("What is the weather in Paris?")
    named = {"type": "function", "function": {"name": "get_weather"}}
    named_t = {"type": "function", "function": {"name": "get_time"}}
    after = [*weather, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21, "sky": "clear"}'}]
    n = 48
    t = {"tools": TOOLS, "max_tokens": n}
    return [
        Case("tool-named", "tools", CHAT, g(messages=weather, tool_choice=named, **t)),
        Case("tool-named-time", "tools", CHAT, g(messages=user("What time is it in Tokyo?"), tool_choice=named_t, **t)),
        Case("tool-named-other", "tools", CHAT, g(messages=user("Tell me a joke."), tool_choice=named, **t)),
        Case("tool-named-stream", "tools", CHAT, g(messages=weather, tool_choice=named, stream=True, **t)),
        Case("tool-named-time-stream", "tools", CHAT, g(messages=user("Time in Berlin?"), tool_choice=named_t,
                                                        stream=True, **t)),
        Case("tool-required", "tools", CHAT, g(messages=weather, tool_choice="required", **t)),
        Case("tool-required-time", "tools", CHAT, g(messages=user("What time is it in Tokyo?"),
                                                    tool_choice="required", **t)),
        Case("tool-required-other", "tools", CHAT, g(messages=user("Hello there."), tool_choice="required", **t)),
        Case("tool-required-stream", "tools", CHAT, g(messages=weather, tool_choice="required", stream=True, **t)),
        Case("tool-auto-weather", "tools", CHAT, g(messages=_auto("What is the weather in Paris?"),
                                                   tool_choice="auto", **t)),
        Case("tool-auto-time", "tools", CHAT, g(messages=_auto("What time is it in Tokyo?"), tool_choice="auto", **t)),
        Case("tool-auto-chat", "tools", CHAT, g(messages=user("Say hi."), tool_choice="auto", **t)),
        Case("tool-auto-default", "tools", CHAT, g(messages=_auto("Weather in Rome?"), **t)),
        Case("tool-auto-weather-stream", "tools", CHAT, g(messages=_auto("What is the weather in Paris?"),
                                                          tool_choice="auto", stream=True, **t)),
        Case("tool-auto-chat-stream", "tools", CHAT, g(messages=user("Say hi."), tool_choice="auto", stream=True,
                                                       **t)),
        Case("tool-none", "tools", CHAT, g(messages=weather, tool_choice="none", **t)),
        Case("tool-after-result", "tools", CHAT, g(messages=after, **t)),
        Case("tool-after-result-none", "tools", CHAT, g(messages=after, tool_choice="none", **t)),
        Case("tool-cmpl-none", "tools", CHAT, g(messages=user("Weather?"), tools=TOOLS[:1], tool_choice="none",
                                                max_tokens=12)),
        Case("tool-named-parallel-off", "tools", CHAT, g(messages=weather, tool_choice=named,
                                                         parallel_tool_calls=False, **t)),
    ]
