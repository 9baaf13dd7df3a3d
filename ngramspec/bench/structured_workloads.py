"""Structured workloads for `ngramspec bench speed`: JSON extraction whose answers copy from the
prompt (12 schemas: nested objects, enums, arrays, bounded numbers, required fields), and tool
calls (three tools in the Hermes format, the call constrained to the chosen tool's schema).

Records are synthetic and deterministic: record i of a schema draws its values from small word
lists with a seeded generator, and the prompt states them in prose, so the answer is copyable.
"""

from __future__ import annotations

import random
from typing import Any

from ngramspec.bench.prompts import BenchPrompt, limit_per_category
from ngramspec.server.tool_calls import render_messages, tool_call_grammar
from ngramspec.structured.params import StructuredOutputsParams

_FIRST = ["Alice", "Bruno", "Chen", "Dalia", "Emil", "Farah", "Goran", "Hana", "Ivo", "Jana"]
_LAST = ["Martin", "Okafor", "Lindqvist", "Moreau", "Tanaka", "Novak", "Silva", "Haddad"]
_CITY = ["Paris", "Lagos", "Oslo", "Kyoto", "Lima", "Prague", "Porto", "Beirut", "Austin"]
_COUNTRY = ["France", "Nigeria", "Norway", "Japan", "Peru", "Czechia", "Portugal", "Lebanon", "USA"]
_WORDS = ["amber", "cobalt", "granite", "harbor", "lumen", "meadow", "nimbus", "orchid", "quartz"]


def _str(n: int = 40) -> dict[str, Any]:
    return {"type": "string", "maxLength": n}


def _obj(props: dict[str, Any], required: list[str] | None = None) -> dict[str, Any]:
    return {"type": "object", "properties": props, "required": required or list(props),
            "additionalProperties": False}


ADDRESS = _obj({"street": _str(), "city": _str(20), "country": _str(20)})
SCHEMAS: list[tuple[str, dict[str, Any]]] = [
    ("customer", _obj({"name": _str(), "email": _str(), "age": {"type": "integer", "minimum": 0,
                       "maximum": 120}, "tier": {"enum": ["bronze", "silver", "gold"]},
                       "address": ADDRESS})),
    ("product", _obj({"sku": _str(12), "title": _str(), "price": {"type": "number", "minimum": 0,
                      "maximum": 10000}, "in_stock": {"type": "boolean"},
                      "tags": {"type": "array", "items": _str(12), "maxItems": 4}})),
    ("invoice", _obj({"number": _str(12), "customer": _str(), "total": {"type": "number"},
                      "currency": {"enum": ["EUR", "USD", "JPY"]},
                      "lines": {"type": "array", "maxItems": 3, "items": _obj(
                          {"item": _str(20), "quantity": {"type": "integer", "minimum": 1,
                                                          "maximum": 99}})}})),
    ("event", _obj({"title": _str(), "city": _str(20), "date": _str(10),
                    "capacity": {"type": "integer", "minimum": 1, "maximum": 100000},
                    "kind": {"enum": ["concert", "talk", "fair"]}})),
    ("book", _obj({"title": _str(), "author": _obj({"first": _str(20), "last": _str(20)}),
                   "year": {"type": "integer", "minimum": 1450, "maximum": 2030},
                   "genres": {"type": "array", "items": {"enum": ["fiction", "history",
                                                                  "science", "poetry"]},
                              "maxItems": 2}})),
    ("employee", _obj({"name": _str(), "team": _str(20), "level": {"type": "integer",
                       "minimum": 1, "maximum": 9}, "remote": {"type": "boolean"},
                       "manager": _str()})),
    ("flight", _obj({"code": _str(8), "origin": _str(20), "destination": _str(20),
                     "seats": {"type": "integer", "minimum": 0, "maximum": 600},
                     "status": {"enum": ["on_time", "delayed", "cancelled"]}})),
    ("order", _obj({"order_id": _str(12), "shipping": ADDRESS,
                    "items": {"type": "array", "maxItems": 3, "items": _str(20)},
                    "express": {"type": "boolean"}})),
    ("weather", _obj({"city": _str(20), "temperature_c": {"type": "number", "minimum": -80,
                      "maximum": 60}, "condition": {"enum": ["sunny", "cloudy", "rain", "snow"]},
                      "wind_kmh": {"type": "integer", "minimum": 0, "maximum": 400}})),
    ("recipe", _obj({"name": _str(), "servings": {"type": "integer", "minimum": 1, "maximum": 20},
                     "ingredients": {"type": "array", "maxItems": 4, "items": _str(20)},
                     "vegetarian": {"type": "boolean"}})),
    ("ticket", _obj({"id": _str(10), "reporter": _str(), "severity": {"enum": ["low", "medium",
                     "high"]}, "summary": _str(60)}, ["id", "severity", "summary"])),
    ("contact", _obj({"name": _str(), "phone": {"type": "string", "pattern":
                      "^[0-9]{3}-[0-9]{4}$"}, "city": _str(20)})),
]


def _record(name: str, i: int) -> tuple[str, str]:
    """(a prose record, the instruction) for record `i` of schema `name`."""
    r = random.Random(f"{name}-{i}")
    first, last, city = r.choice(_FIRST), r.choice(_LAST), r.randrange(len(_CITY))
    word, n = r.choice(_WORDS), r.randint(2, 90)
    person = f"{first} {last}"
    text = {
        "customer": f"Customer {person} (email {first.lower()}.{last.lower()}@example.com), age "
                    f"{n}, is a {r.choice(['bronze', 'silver', 'gold'])} member living at {n} "
                    f"{word.title()} Street, {_CITY[city]}, {_COUNTRY[city]}.",
        "product": f"Product SKU {word[:3].upper()}-{n:03d}: the {word.title()} Lamp, priced "
                   f"{n * 3}.99, currently {'in stock' if n % 2 else 'sold out'}; tags: {word}, "
                   f"lamp, home.",
        "invoice": f"Invoice INV-{n:04d} for {person}: {n % 5 + 1} x {word} widget and 2 x "
                   f"service hour, total {n * 11}.50 EUR.",
        "event": f"The {word.title()} Festival, a fair in {_CITY[city]} on 2027-0{n % 9 + 1}-1{n % 9}"
                 f", has room for {n * 100} visitors.",
        "book": f"'{word.title()} Nights' by {person}, first published in {1900 + n}, is a "
                f"history book.",
        "employee": f"{person} works remotely on the {word} team at level {n % 9 + 1}, reporting "
                    f"to {r.choice(_FIRST)} {r.choice(_LAST)}.",
        "flight": f"Flight {word[:2].upper()}{n * 7} from {_CITY[city]} to "
                  f"{_CITY[(city + 1) % len(_CITY)]} has {n * 3} seats left and is delayed.",
        "order": f"Order ORD-{n:05d} ships express to {n} {word.title()} Road, {_CITY[city]}, "
                 f"{_COUNTRY[city]}; items: {word} mug, {word} poster.",
        "weather": f"Weather in {_CITY[city]}: {n % 35}.5 degrees Celsius, cloudy, wind {n} km/h.",
        "recipe": f"{word.title()} soup serves {n % 8 + 1}; ingredients: {word} beans, onion, "
                  f"garlic, salt. It is vegetarian.",
        "ticket": f"Ticket T-{n:04d} reported by {person}: high severity, '{word} page fails to "
                  f"load after login'.",
        "contact": f"Contact {person}, phone {n + 100}-{n * 37 % 10000:04d}, lives in "
                   f"{_CITY[city]}.",
    }[name]
    return text, f"Extract the {name} from this record as JSON."


def extraction_prompt(name: str, i: int) -> str:
    text, ask = _record(name, i)
    return f"{text}\n\n{ask}"


def structured(limit: int | None = None, per_schema: int = 2) -> list[BenchPrompt]:
    prompts = [BenchPrompt(f"{name}-{i}", name, extraction_prompt(name, i), 160,
                           StructuredOutputsParams(json=schema))
               for name, schema in SCHEMAS for i in range(per_schema)]
    return limit_per_category(prompts, limit)


WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city",
    "parameters": _obj({"city": _str(30), "unit": {"enum": ["celsius", "fahrenheit"]}})}}
LOOKUP_TOOL = {"type": "function", "function": {
    "name": "lookup_customer", "description": "Find a customer record",
    "parameters": _obj({"name": _str(), "email": _str(), "city": _str(20)})}}
NOTE_TOOL = {"type": "function", "function": {
    "name": "save_note", "description": "Save a note to the user's notebook",
    "parameters": _obj({"title": _str(60), "text": _str(600)})}}
TOOLS = [WEATHER_TOOL, LOOKUP_TOOL, NOTE_TOOL]
_NOTES = [
    "Call the plumber on Monday about the leaking kitchen tap, ask for a quote before any work "
    "starts, and remind him that the water main is under the stairs.",
    "Buy oat milk, two lemons, basil, a loaf of rye bread and coffee beans; the shop on Elm "
    "Street closes at seven, so go before the evening train.",
    "The quarterly report is due on the fifteenth; Dalia sends the sales figures, Emil checks "
    "the charts, and the draft goes to the board a week before.",
    "Water the tomatoes every second day while we are away, keep the greenhouse door open in the "
    "afternoon, and pick the ripe ones before the weekend.",
]


def tool_calls(limit: int | None = None, per_tool: int = 8) -> list[BenchPrompt]:
    """Requests answered by a call (tool_choice "required"): the arguments copy from the
    request (a city, a customer, a note to save), the Hermes prompt lists the three tools."""
    system = render_messages([], TOOLS, knows_tools=False)[0]["content"]
    grammar = tool_call_grammar(TOOLS, None, parallel=False)
    prompts = []
    for i in range(per_tool):
        r = random.Random(f"tool-{i}")
        city = r.choice(_CITY)
        first, last = r.choice(_FIRST), r.choice(_LAST)
        asks = {
            "get_weather": f"Is it warm in {city} right now? Give me the temperature in "
                           f"{r.choice(['celsius', 'fahrenheit'])}.",
            "lookup_customer": f"Find the customer {first} {last} "
                               f"({first.lower()}.{last.lower()}@example.com) from {city}.",
        }
        note = _NOTES[i % len(_NOTES)]
        asks["save_note"] = (f"Save this as a note titled '{r.choice(_WORDS).title()} plan': "
                             f"{note}")
        for tool, ask in asks.items():
            prompts.append(BenchPrompt(f"{tool}-{i}", tool, ask, 160,
                                       StructuredOutputsParams(grammar=grammar), system))
    return limit_per_category(prompts, limit)
