-- Small key/value settings (snapshot generation, seeded-config markers).
CREATE TABLE settings (
    key TEXT PRIMARY KEY,
    value TEXT NOT NULL,
    updated_us INTEGER NOT NULL
);
