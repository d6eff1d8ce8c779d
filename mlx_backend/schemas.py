"""JSON schemas as this backend constrains them: an object holds only the keys its
``properties`` (or ``required``) declare unless it says otherwise, and whitespace
is bounded.

A schema's ``additionalProperties`` stands wherever it is given. Where it is
absent from an object that declares ``properties``, no other key is allowed, as
llama.cpp's grammars and OpenAI's strict mode do: a key the schema never named
is one no client can read. An object that declares no properties stays any
object (``{"type": "object"}``, JSON mode).
"""

# Whitespace llguidance allows at each place JSON allows it: a space or two, or
# a line break and indentation (llama.cpp's grammars allow up to 20 columns).
WHITESPACE = r"[ \t]{1,2}|\r?\n[ \t]{0,20}"

# Keywords under which a value is itself a schema, or a map or list of schemas.
_SCHEMA_VALUES = ("items", "additionalItems", "not", "contains", "if", "then", "else")
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")
_SCHEMA_LISTS = ("anyOf", "oneOf", "prefixItems")
# An object whose keys these decide (or merge with another schema's) is left as is.
_OPEN_KEYS = (
    "additionalProperties",
    "patternProperties",
    "unevaluatedProperties",
    "allOf",
    "$ref",
)


def strict_schema(schema: dict) -> dict:
    """``schema`` with ``additionalProperties: false`` on each object that declares
    ``properties`` and says nothing of other keys, and bounded whitespace."""
    strict = _closed(schema, merged=False)
    guidance = {"whitespace_pattern": WHITESPACE, **schema.get("x-guidance", {})}
    return {**strict, "x-guidance": guidance}


def _closed(schema, merged: bool):
    if not isinstance(schema, dict):
        return schema
    closed = dict(schema)
    for key in _SCHEMA_VALUES:
        if key in closed:
            closed[key] = _closed(closed[key], merged=False)
    if isinstance(closed.get("additionalProperties"), dict):
        closed["additionalProperties"] = _closed(
            closed["additionalProperties"], merged=False
        )
    for key in _SCHEMA_MAPS:
        if isinstance(closed.get(key), dict):
            closed[key] = {k: _closed(v, False) for k, v in closed[key].items()}
    for key in _SCHEMA_LISTS:
        if isinstance(closed.get(key), list):
            closed[key] = [_closed(v, False) for v in closed[key]]
    if isinstance(closed.get("allOf"), list):
        # allOf's members merge: each one's keys must stay open to the others'.
        closed["allOf"] = [_closed(v, True) for v in closed["allOf"]]
    declares = isinstance(closed.get("properties"), dict)
    if declares and not merged and not any(key in closed for key in _OPEN_KEYS):
        # A key the schema requires but does not describe is declared too.
        required = [k for k in closed.get("required") or () if isinstance(k, str)]
        undescribed = {k: {} for k in required if k not in closed["properties"]}
        closed["properties"] = {**closed["properties"], **undescribed}
        closed["additionalProperties"] = False
    return closed
