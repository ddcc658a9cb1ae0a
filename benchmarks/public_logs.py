"""Public logs as a new user would bring them to ``recloop replay``: MovieLens ratings and a Criteo click sample.

The files are fetched by whoever runs this (they are not in the repository: their licences and sizes keep
them out) and written into a folder of landing files plus a dataset spec:

- ``movielens``: GroupLens' ml-latest-small (``ratings.csv`` + ``movies.csv``, 100,836 ratings by 610 users
  of 9,742 movies, 1996–2018). A rating of 4 or more is a like (label 1), keys ``userId``/``movieId`` as
  MovieLens writes them, the movie's genres as a list of genre ids, its year from the title;
- ``movielens-1m``: GroupLens' MovieLens 1M as ``ratings.dat`` / ``movies.dat`` / ``users.dat`` (``::``-separated,
  movies in Latin-1): the same like rule, keys and genres, and each user's gender, age band and occupation as
  categorical columns. ``--until DATE`` keeps the ratings before that day (the dense stretch of a log whose
  tail thins out: a replay of its last weeks then scores tens of thousands of rows a period, not hundreds);
- ``criteo``: rows of Criteo's Kaggle display-advertising ``train.txt`` (headerless TSV, label, 13 counts, 26
  hashed categories), in their published order, cut into ``--days`` files ``day_N.txt`` that the shipped
  ``criteo`` spec stamps one day each (the rows carry no time; their order is Criteo's).

    python benchmarks/public_logs.py movielens --source /tmp/ml-latest-small --out /tmp/movielens
    python benchmarks/public_logs.py movielens-1m --source /tmp/ml-1m --out /tmp/ml1m --until 2001-01-01
    recloop replay --data /tmp/ml1m/log --spec /tmp/ml1m/movielens_1m.yaml --period week --periods 4
    python benchmarks/public_logs.py criteo --source /tmp/criteo/train.txt --out /tmp/criteo-days --days 8
    recloop replay --data /tmp/movielens/log --spec /tmp/movielens/movielens.yaml --period auto --periods 4
"""

from __future__ import annotations

import argparse
import csv
import hashlib
import re
from datetime import UTC, datetime
from pathlib import Path

GENRES = ("(no genres listed)", "Action", "Adventure", "Animation", "Children", "Comedy", "Crime", "Documentary",
          "Drama", "Fantasy", "Film-Noir", "Horror", "IMAX", "Musical", "Mystery", "Romance", "Sci-Fi", "Thriller",
          "War", "Western")

def _movielens_spec(comment: str, name: str, description: str, first_day: str, genres: int, extra: str = "") -> str:
    """A MovieLens ratings spec as this script writes the log: a rating of 4 or more is a like, keys as
    MovieLens names them, genres as a list of ids, the movie's year; ``extra``: more column lines."""
    return f"""\
# {comment}
name: {name}
description: {description}
format: table
on_extra_columns: quarantine
integral_floats: true
events: chosen
columns:
  - {{name: rating_id, role: event_id, dtype: string}}
  - {{name: timestamp, role: timestamp, dtype: timestamp, format: epoch_s, min: "{first_day}"}}
  - {{name: userId, role: user_key, dtype: int64, min: 1}}
  - {{name: movieId, role: item_key, dtype: int64, min: 1}}
  - {{name: liked, role: label, dtype: int8, allowed: [0, 1], description: "rating >= 4"}}
  - {{name: genres, role: multi_hot, dtype: list<int64>, min: 0, max: {genres - 1}, separator: "|", nullable: true}}
  - {{name: year, role: numeric, dtype: int64, min: 1900, max: 2030, nullable: true}}
{extra}"""


MOVIELENS_SPEC = _movielens_spec(
    "GroupLens' ml-latest-small as benchmarks/public_logs.py writes it: a rating of 4 or more is a like.",
    "movielens", "MovieLens ratings (liked = 4 stars or more), keys as MovieLens names them.", "1995-01-01", 20)

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


MOVIELENS_1M_SPEC = _movielens_spec(
    "GroupLens' MovieLens 1M as benchmarks/public_logs.py writes it: a rating of 4 or more is a like; the raters'\n"
    "# demographics (users.dat) ride on each rating as categorical columns.",
    "movielens_1m", "MovieLens 1M ratings (liked = 4 stars or more) with the raters' gender, age band and occupation.",
    "2000-01-01", 18, """\
  - {name: gender, role: categorical, dtype: string, nullable: true}
  - {name: age, role: categorical, dtype: int64, nullable: true, description: "age band: 1, 18, 25, 35, 45, 50, 56"}
  - {name: occupation, role: categorical, dtype: int64, nullable: true, description: "0-20, users.dat's codes"}
""")
GENRES_1M = ("Action", "Adventure", "Animation", "Children's", "Comedy", "Crime", "Documentary", "Drama", "Fantasy",
             "Film-Noir", "Horror", "Musical", "Mystery", "Romance", "Sci-Fi", "Thriller", "War", "Western")


def movielens_1m(source: Path, out: Path, until: str | None = None) -> Path:
    """``ratings.dat`` + ``movies.dat`` + ``users.dat`` → ``out/log/ratings.csv`` and ``out/movielens_1m.yaml``
    (ratings from before ``until``, an ISO date, when given); returns ``out``."""
    genre_id = {name: index for index, name in enumerate(GENRES_1M)}
    movies = {}
    for line in (source / "movies.dat").read_text(encoding="latin-1").splitlines():
        if line.strip():
            movie_id, title, genres = line.split("::")
            year = re.search(r"\((\d{4})\)\s*$", title.strip())
            movies[movie_id] = ("|".join(str(genre_id[g]) for g in genres.split("|") if g in genre_id),
                                year.group(1) if year else "")
    users = {}
    for line in (source / "users.dat").read_text(encoding="latin-1").splitlines():
        if line.strip():
            user_id, gender, age, occupation, _zip = line.split("::")
            users[user_id] = (gender, age, occupation)
    cutoff = datetime.fromisoformat(until).replace(tzinfo=UTC).timestamp() if until else float("inf")
    (out / "log").mkdir(parents=True, exist_ok=True)
    rows = kept = 0
    with (source / "ratings.dat").open(encoding="latin-1") as handle, \
            (out / "log" / "ratings.csv").open("w", newline="") as target:
        writer = csv.writer(target)
        writer.writerow(["rating_id", "timestamp", "userId", "movieId", "liked", "genres", "year", "gender", "age",
                         "occupation"])
        for line in handle:
            if not line.strip():
                continue
            rows += 1
            user_id, movie_id, rating, timestamp = line.strip().split("::")
            if int(timestamp) >= cutoff:
                continue
            kept += 1
            genres, year = movies.get(movie_id, ("", ""))
            writer.writerow([f"{user_id}-{movie_id}", timestamp, user_id, movie_id, int(int(rating) >= 4), genres, year,
                             *users.get(user_id, ("", "", ""))])
    (out / "movielens_1m.yaml").write_text(MOVIELENS_1M_SPEC)
    digest = hashlib.sha256((source / "ratings.dat").read_bytes()).hexdigest()[:16]
    (out / "SOURCE").write_text(f"{source / 'ratings.dat'} sha256:{digest} rows:{rows} kept:{kept} until:{until}\n")
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
    parser.add_argument("log", choices=["movielens", "movielens-1m", "criteo"])
    parser.add_argument("--source", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--days", type=int, default=8, help="criteo: the files the rows are cut into")
    parser.add_argument("--until", help="movielens-1m: keep the ratings before this ISO date")
    args = parser.parse_args()
    if args.log == "movielens":
        done = movielens(args.source, args.out)
    elif args.log == "movielens-1m":
        done = movielens_1m(args.source, args.out, args.until)
    else:
        done = criteo(args.source, args.out, args.days)
    print(done)


if __name__ == "__main__":
    main()
