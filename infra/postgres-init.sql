-- One PostgreSQL, one database per engine.
CREATE DATABASE prefect OWNER recloop;
CREATE DATABASE mlflow OWNER recloop;
CREATE DATABASE feast OWNER recloop;
