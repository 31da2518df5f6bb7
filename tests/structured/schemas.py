"""JSON schemas the structured-output tests decode under (each with a prompt that asks for it).

Strings and arrays are bounded where the model could otherwise go on past the token budget; a
constrained output that runs out of tokens finishes "length" and is not claimed valid, but
these tests want every output complete.
"""

import json

NAME = {"type": "string", "minLength": 1, "maxLength": 24}
PERSON = {"type": "object", "properties": {"name": NAME, "age": {"type": "integer",
                                                                  "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}

SCHEMAS = {
    "person": PERSON,
    "nested_address": {
        "type": "object", "additionalProperties": False, "required": ["name", "address"],
        "properties": {"name": NAME, "address": {
            "type": "object", "additionalProperties": False, "required": ["street", "city"],
            "properties": {"street": NAME, "city": NAME}}}},
    "int_array_bounds": {"type": "array", "items": {"type": "integer", "minimum": 0,
                                                    "maximum": 99},
                         "minItems": 2, "maxItems": 4},
    "enum_array": {"type": "array", "items": {"enum": ["red", "green", "blue"]},
                   "minItems": 1, "maxItems": 3},
    "enum_string": {"type": "string", "enum": ["cat", "dog", "bird"]},
    "const": {"type": "object", "properties": {"kind": {"const": "point"}, "x": {"type": "integer"}},
              "required": ["kind", "x"], "additionalProperties": False},
    "number_bounds": {"type": "object", "additionalProperties": False, "required": ["t"],
                      "properties": {"t": {"type": "number", "minimum": -10,
                                           "exclusiveMaximum": 50}}},
    "integer_bounds": {"type": "integer", "minimum": 10, "maximum": 20},
    "string_pattern": {"type": "object", "additionalProperties": False, "required": ["code"],
                       "properties": {"code": {"type": "string",
                                               "pattern": "^[A-Z]{3}-[0-9]{2}$"}}},
    "format_date": {"type": "object", "additionalProperties": False, "required": ["day"],
                    "properties": {"day": {"type": "string", "format": "date"}}},
    "format_email": {"type": "object", "additionalProperties": False, "required": ["email"],
                     "properties": {"email": {"type": "string", "format": "email",
                                              "maxLength": 40}}},
    "format_datetime": {"type": "string", "format": "date-time"},
    "format_uuid": {"type": "string", "format": "uuid"},
    "optional_fields": {
        "type": "object", "additionalProperties": False, "required": ["title"],
        "properties": {"title": NAME, "year": {"type": "integer", "minimum": 1900,
                                               "maximum": 2100},
                       "rating": {"type": "number", "minimum": 0, "maximum": 10}}},
    "any_of": {"type": "object", "additionalProperties": False, "required": ["id"],
               "properties": {"id": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 9999},
                                               {"type": "string", "maxLength": 12}]}}},
    "one_of_objects": {"oneOf": [
        {"type": "object", "additionalProperties": False, "required": ["circle"],
         "properties": {"circle": {"type": "number", "minimum": 0, "maximum": 100}}},
        {"type": "object", "additionalProperties": False, "required": ["square"],
         "properties": {"square": {"type": "integer", "minimum": 0, "maximum": 100}}}]},
    "defs_ref": {"$defs": {"point": {"type": "object", "additionalProperties": False,
                                     "required": ["x", "y"],
                                     "properties": {"x": {"type": "integer"},
                                                    "y": {"type": "integer"}}}},
                 "type": "object", "additionalProperties": False, "required": ["start", "end"],
                 "properties": {"start": {"$ref": "#/$defs/point"},
                                "end": {"$ref": "#/$defs/point"}}},
    "recursive_tree": {"$defs": {"node": {
        "type": "object", "additionalProperties": False, "required": ["value"],
        "properties": {"value": {"type": "integer", "minimum": 0, "maximum": 9},
                       "children": {"type": "array", "maxItems": 2,
                                    "items": {"$ref": "#/$defs/node"}}}}},
        "$ref": "#/$defs/node"},
    "recursive_list": {"$defs": {"cell": {
        "type": "object", "additionalProperties": False, "required": ["head", "tail"],
        "properties": {"head": {"type": "integer", "minimum": 0, "maximum": 9},
                       "tail": {"anyOf": [{"$ref": "#/$defs/cell"}, {"type": "null"}]}}}},
        "$ref": "#/$defs/cell"},
    "boolean": {"type": "object", "additionalProperties": False, "required": ["ok"],
                "properties": {"ok": {"type": "boolean"}}},
    "nullable": {"type": "object", "additionalProperties": False, "required": ["nick"],
                 "properties": {"nick": {"type": ["string", "null"], "maxLength": 16}}},
    "array_of_objects": {"type": "array", "minItems": 1, "maxItems": 3, "items": PERSON},
    "string_lengths": {"type": "object", "additionalProperties": False, "required": ["word"],
                       "properties": {"word": {"type": "string", "minLength": 3,
                                               "maxLength": 8}}},
    "enum_integers": {"type": "object", "additionalProperties": False, "required": ["level"],
                      "properties": {"level": {"enum": [1, 2, 3, 5, 8]}}},
    "object_with_array": {
        "type": "object", "additionalProperties": False, "required": ["team", "members"],
        "properties": {"team": NAME, "members": {"type": "array", "minItems": 1, "maxItems": 3,
                                                 "items": NAME}}},
    "all_of": {"allOf": [{"type": "object", "properties": {"a": {"type": "integer"}},
                          "required": ["a"]},
                         {"type": "object", "properties": {"b": {"type": "boolean"}},
                          "required": ["b"]}],
               "additionalProperties": False, "properties": {"a": {}, "b": {}}},
    "multiple_of": {"type": "object", "additionalProperties": False, "required": ["n"],
                    "properties": {"n": {"type": "integer", "multipleOf": 5, "minimum": 0,
                                         "maximum": 100}}},
    "prefix_items": {"type": "array", "prefixItems": [{"type": "string", "maxLength": 10},
                                                      {"type": "integer"},
                                                      {"type": "boolean"}],
                     "items": False},
    "pydantic_style": {
        "$defs": {"Item": {"properties": {"sku": {"title": "Sku", "type": "string",
                                                  "maxLength": 12},
                                          "qty": {"title": "Qty", "type": "integer",
                                                  "minimum": 1, "maximum": 9}},
                           "required": ["sku", "qty"], "title": "Item", "type": "object",
                           "additionalProperties": False}},
        "properties": {"order_id": {"title": "Order Id", "type": "integer"},
                       "items": {"items": {"$ref": "#/$defs/Item"}, "title": "Items",
                                 "type": "array", "maxItems": 2}},
        "required": ["order_id", "items"], "title": "Order", "type": "object",
        "additionalProperties": False},
    "min_properties": {"type": "object", "minProperties": 1, "maxProperties": 2,
                       "additionalProperties": {"type": "integer", "minimum": 0,
                                                "maximum": 9},
                       "patternProperties": {"^[a-z]{1,6}$": {"type": "integer"}}},
    "top_level_array_of_enums_and_numbers": {
        "type": "array", "minItems": 1, "maxItems": 3,
        "items": {"anyOf": [{"enum": ["low", "high"]},
                            {"type": "number", "minimum": 0, "maximum": 1}]}},
}

PROMPTS = {
    name: "Reply with JSON only. Give an example that fits this JSON schema: "
          + json.dumps(schema)
    for name, schema in SCHEMAS.items()
}
# A recursive schema lets the model nest without end; these prompts ask for a small instance.
PROMPTS["recursive_tree"] = ('Reply with JSON only, this tree exactly: {"value": 4, '
                             '"children": [{"value": 5, "children": []}]}')
PROMPTS["recursive_list"] = ('Reply with JSON only: the two-cell list {"head": 1, "tail": '
                             '{"head": 2, "tail": null}}')
