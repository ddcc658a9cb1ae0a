"""Public logs as a new user would bring them to ``recloop replay``: MovieLens ratings and a Criteo click sample.

The files are fetched by whoever runs this (they are not in the repository: their licences and sizes keep
them out) and written into a folder of landing files plus a dataset spec:

- ``movielens``: GroupLens' ml-latest-small (``ratings.csv`` + ``movies.csv``, 100,836 ratings by 610 users
  of 9,742 movies, 1996–2018). A rating of 4 or more is a like (label 1), keys ``userId``/``movieId`` as
  MovieLens writes them, the movie's genres as a list of genre ids, its year from the title;
- ``criteo``: rows of Criteo's Kaggle display-advertising ``train.txt`` (headerless TSV, label, 13 counts, 26
  hashed categories), in their published order, cut into ``--days`` files ``day_N.txt`` that the shipped
  ``criteo`` spec stamps one day each (the rows carry no time; their order is Criteo's).

    python benchmarks/public_logs.py movielens --source /tmp/ml-latest-small --out /tmp/movielens
    python benchmarks/public_logs.py criteo --source /tmp/criteo/train.txt --out /tmp/criteo-days --days 8
    recloop replay --data /tmp/movielens/log --spec /tmp/movielens/movielens.yaml --period auto --periods 4
"""

from __future__ import annotations

import argparse
import csv
import hashlib
import re
from pathlib import Path

GENRES = ("(no genres listed)", "Action", "Adventure", "Animation", "Children", "Comedy", "Crime", "Documentary",
          "Drama", "Fantasy", "Film-Noir", "Horror", "IMAX", "Musical", "Mystery", "Romance", "Sci-Fi", "Thriller",
          "War", "Western")

MOVIELENS_SPEC = """\
# GroupLens' ml-latest-small as benchmarks/public_logs.py writes it: a rating of 4 or more is a like.
name: movielens
description: MovieLens ratings (liked = 4 stars or more), keys as MovieLens names them.
format: table
on_extra_columns: quarantine
integral_floats: true
events: chosen
columns:
  - {name: rating_id, role: event_id, dtype: string}
  - {name: timestamp, role: timestamp, dtype: timestamp, format: epoch_s, min: "1995-01-01"}
  - {name: userId, role: user_key, dtype: int64, min: 1}
  - {name: movieId, role: item_key, dtype: int64, min: 1}
  - {name: liked, role: label, dtype: int8, allowed: [0, 1], description: "rating >= 4"}
  - {name: genres, role: multi_hot, dtype: list<int64>, min: 0, max: 19, separator: "|", nullable: true}
  - {name: year, role: numeric, dtype: int64, min: 1900, max: 2030, nullable: true}
"""


def movielens(source: Path, out: Path) -> Path:
    """``ratings.csv`` + ``movies.csv`` → ``out/log/ratings.csv`` and ``out/movielens.yaml``; returns ``out``."""
    genre_id = {name: index for index, name in enumerate(GENRES)}
    movies = {}
    with (source / "movies.csv").open(newline="", encoding="utf-8") as handle:
        for row in csv.DictReader(handle):
            year = re.search(r"\((\d{4})\)\s*$", row["title"].strip())
            genres = "|".join(str(genre_id[g]) for g in row["genres"].split("|") if g in genre_id)
            movies[row["movieId"]] = (genres, year.group(1) if year else "")
    (out / "log").mkdir(parents=True, exist_ok=True)
    with (source / "ratings.csv").open(newline="") as handle, \
            (out / "log" / "ratings.csv").open("w", newline="") as target:
        writer = csv.writer(target)
        writer.writerow(["rating_id", "timestamp", "userId", "movieId", "liked", "genres", "year"])
        for row in csv.DictReader(handle):
            genres, year = movies.get(row["movieId"], ("", ""))
            writer.writerow([f"{row['userId']}-{row['movieId']}", row["timestamp"], row["userId"], row["movieId"],
                             int(float(row["rating"]) >= 4.0), genres, year])
    (out / "movielens.yaml").write_text(MOVIELENS_SPEC)
    return out


def criteo(source: Path, out: Path, days: int) -> Path:
    """Criteo ``train.txt`` rows cut, in order, into ``days`` files ``out/log/day_N.txt``; returns ``out``."""
    lines = [line for line in source.read_text().splitlines() if line.strip()]
    (out / "log").mkdir(parents=True, exist_ok=True)
    per_day = -(-len(lines) // days)
    for day in range(days):
        part = lines[day * per_day:(day + 1) * per_day]
        if part:
            (out / "log" / f"day_{day}.txt").write_text("\n".join(part) + "\n")
    digest = hashlib.sha256(source.read_bytes()).hexdigest()[:16]
    (out / "SOURCE").write_text(f"{source} sha256:{digest} rows:{len(lines)} days:{days}\n")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("log", choices=["movielens", "criteo"])
    parser.add_argument("--source", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--days", type=int, default=8)
    args = parser.parse_args()
    done = movielens(args.source, args.out) if args.log == "movielens" else criteo(args.source, args.out, args.days)
    print(done)


if __name__ == "__main__":
    main()
