"""A structured-output library through the server: `instructor` (PyPI) patches the official openai
client and asks for a pydantic model in its JSON_SCHEMA mode (`response_format: json_schema`).

The model is tiny and random, so what it says is noise; the grammar is what is checked. Every
object instructor hands back validates, and the raw text it came from satisfies the schema by
`jsonschema` (the reference, not the server's own grammar engine). Streaming partial objects ends
at the same object as the whole answer. A schema whose language is empty comes back as an
`openai.BadRequestError` naming `response_format`, and the server answers the next request.

The schemas turn off llguidance's flexible JSON whitespace (its `x-guidance` key): a random model
would otherwise fill the answer with blanks until max_tokens. instructor's JSON mode
(`json_object`: any keys, any whitespace) is left out for the same reason.
"""
import json
from typing import Literal

import jsonschema
import openai
import pytest
from pydantic import BaseModel, ConfigDict, Field

from minillm.serve import running
from serve_tiny import MODEL, settles, tiny_llm  # noqa: F401 (settles: an autouse fixture)

instructor = pytest.importorskip("instructor", reason="instructor is not installed (the dev extra)")
from instructor.core.exceptions import InstructorRetryException  # noqa: E402

STRICT = ConfigDict(extra="forbid", json_schema_extra={"x-guidance": {"whitespace_flexible": False}})


class Tag(BaseModel):
    model_config = STRICT
    label: str = Field(max_length=8)
    weight: int = Field(ge=-5, le=5)


class City(BaseModel):
    model_config = STRICT
    name: str = Field(max_length=12)
    country: Literal["France", "Italy", "Spain"]
    population: int = Field(ge=0, le=10**7)
    capital: bool
    tags: list[Tag] = Field(max_length=2)


class NoList(BaseModel):                   # minItems > maxItems: no JSON value fits
    xs: list[int] = Field(min_length=3, max_length=1)


class NoEnum(BaseModel):                   # an enum of nothing
    colour: str = Field(json_schema_extra={"enum": []})


ASK = [{"role": "user", "content": "Describe a city."}]


@pytest.fixture(scope="module")
def srv(tok):
    with running(tiny_llm(tok), served_model_name=MODEL) as s:
        yield s


@pytest.fixture(scope="module")
def client(srv):
    oc = openai.OpenAI(base_url=srv.base_url, api_key="none", max_retries=0)
    return instructor.from_openai(oc, mode=instructor.Mode.JSON_SCHEMA)


def ask(client, model, **kw):
    return client.chat.completions.create_with_completion(
        model=MODEL, response_model=model, messages=ASK, max_retries=0, max_tokens=120, **kw)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_instructor_gets_validated_objects_that_satisfy_the_schema(client, seed):
    city, completion = ask(client, City, temperature=1.0, seed=seed)
    choice = completion.choices[0]
    assert choice.finish_reason == "stop"
    raw = json.loads(choice.message.content)
    jsonschema.validate(raw, City.model_json_schema())        # the reference validator
    assert isinstance(city, City) and city.model_dump() == City.model_validate(raw).model_dump()
    assert completion.usage.completion_tokens <= 120


def test_streamed_partials_end_at_the_whole_answer(client):
    whole, _ = ask(client, City, temperature=0)
    parts = list(client.chat.completions.create_partial(
        model=MODEL, response_model=City, messages=ASK, max_retries=0, max_tokens=120,
        temperature=0))
    assert len(parts) > 1                                      # it did stream
    assert City.model_validate(parts[-1].model_dump()).model_dump() == whole.model_dump()


@pytest.mark.parametrize("model", [NoList, NoEnum])
def test_an_unsatisfiable_schema_is_a_bad_request_instructor_can_read(client, model):
    with pytest.raises(InstructorRetryException) as info:
        ask(client, model)
    err = info.value.__cause__
    assert isinstance(err, openai.BadRequestError) and err.status_code == 400
    assert err.body["param"] == "response_format" and err.body["type"] == "invalid_request_error"
    assert info.value.n_attempts == 1
    city, _ = ask(client, City, temperature=0)                  # the next request is answered
    assert isinstance(city, City)
