"""``/v1/files`` with ids no file can have (control characters, a NUL; the
fuzz test's GET ``/v1/files/<control characters>``), on SQLite and on a real
PostgreSQL: each a 404 ``No such File object`` as an unknown id is, a cursor
(``after``) of that kind starts from the top as another key's id does, and a
purpose with a NUL lists nothing. PostgreSQL refuses a NUL in a text
parameter: before the id's shape was checked, each answered 503
``store_unavailable`` there, as if the store were down. The router app served
by uvicorn, called over HTTP (httpx: the openai client quotes ids itself)."""

import httpx

from tests.gateway.test_files import jsonl, router

ODD_IDS = ["%00", "file-%00abc", "%01%02%1f%7f", "file-a%0Ab", "file-staging-x"]


async def test_ids_no_file_can_have_are_404_on_every_store(store_url: str) -> None:
    async with router(store_url) as r:
        key = r.key()
        auth = {"Authorization": f"Bearer {key}"}
        async with httpx.AsyncClient(base_url=r.base, headers=auth) as http:
            made = await http.post(
                "/v1/files", files={"file": ("in.jsonl", jsonl(2))}, data={"purpose": "batch"}
            )
            assert made.status_code == 200, made.text
            file_id = made.json()["id"]
            for odd in ODD_IDS:
                for method, path in (
                    ("GET", f"/v1/files/{odd}"),
                    ("GET", f"/v1/files/{odd}/content"),
                    ("DELETE", f"/v1/files/{odd}"),
                ):
                    answer = await http.request(method, path)
                    assert answer.status_code == 404, (method, path, answer.text)
                    assert answer.json()["error"]["message"].startswith("No such File object")
                listed = await http.get(f"/v1/files?after={odd}")
                assert listed.status_code == 200, (odd, listed.text)
                assert [f["id"] for f in listed.json()["data"]] == [file_id]
            none = await http.get("/v1/files?purpose=batch%00")
            assert none.status_code == 200, none.text
            assert none.json()["data"] == []
            # The real file is untouched and still served.
            again = await http.get(f"/v1/files/{file_id}")
            assert again.status_code == 200 and again.json()["id"] == file_id
