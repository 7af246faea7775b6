//! Promotions through gpuhub's gate: what gpuhub serves per MLflow registered model.

use sqlx::Row;

use super::{Store, StoreError};

/// One promotion as recorded (before MLflow's alias is moved).
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct PromotionRow {
    pub model: String,
    pub version: String,
    pub previous_version: Option<String>,
    pub metric: Option<String>,
    pub value: Option<f64>,
    pub previous_value: Option<f64>,
    pub threshold: Option<f64>,
    pub forced: bool,
    pub uid: i64,
    pub user_name: String,
    pub at_us: i64,
}

const COLUMNS: &str = "model, version, previous_version, metric, value, previous_value, threshold, forced, uid, user_name, at_us";

impl Store {
    pub async fn record_promotion(&self, p: &PromotionRow) -> Result<(), StoreError> {
        sqlx::query(&format!("INSERT INTO model_promotions ({COLUMNS}) VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11)"))
            .bind(&p.model)
            .bind(&p.version)
            .bind(&p.previous_version)
            .bind(&p.metric)
            .bind(p.value)
            .bind(p.previous_value)
            .bind(p.threshold)
            .bind(i64::from(p.forced))
            .bind(p.uid)
            .bind(&p.user_name)
            .bind(p.at_us)
            .execute(self.pool())
            .await?;
        Ok(())
    }

    /// The latest promotion of every model (what gpuhub serves), by model.
    pub async fn promoted_versions(&self) -> Result<Vec<PromotionRow>, StoreError> {
        let rows = sqlx::query(&format!(
            "SELECT {COLUMNS} FROM model_promotions p WHERE id = (SELECT MAX(id) FROM model_promotions q WHERE q.model = p.model) ORDER BY model"
        ))
        .fetch_all(self.pool())
        .await?;
        rows.iter().map(from_row).collect::<Result<_, sqlx::Error>>().map_err(StoreError::from)
    }

    /// `model`'s promotions, newest first.
    pub async fn promotions(&self, model: &str) -> Result<Vec<PromotionRow>, StoreError> {
        let rows = sqlx::query(&format!("SELECT {COLUMNS} FROM model_promotions WHERE model = $1 ORDER BY id DESC"))
            .bind(model)
            .fetch_all(self.pool())
            .await?;
        rows.iter().map(from_row).collect::<Result<_, sqlx::Error>>().map_err(StoreError::from)
    }
}

fn from_row(r: &sqlx::any::AnyRow) -> Result<PromotionRow, sqlx::Error> {
    Ok(PromotionRow {
        model: r.try_get(0)?,
        version: r.try_get(1)?,
        previous_version: r.try_get(2)?,
        metric: r.try_get(3)?,
        value: r.try_get(4)?,
        previous_value: r.try_get(5)?,
        threshold: r.try_get(6)?,
        forced: r.try_get::<i64, _>(7)? != 0,
        uid: r.try_get(8)?,
        user_name: r.try_get(9)?,
        at_us: r.try_get(10)?,
    })
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use crate::store::testing;

    #[tokio::test]
    async fn promotions_round_trip_and_the_latest_wins_on_every_backend() {
        for (store, _dir) in testing::stores().await {
            let first = PromotionRow {
                model: "smollm".into(),
                version: "1".into(),
                previous_version: None,
                metric: Some("eval_accuracy".into()),
                value: Some(0.8),
                previous_value: None,
                threshold: Some(0.7),
                forced: false,
                uid: 0,
                user_name: "root".into(),
                at_us: 1_700_000_000_000_000,
            };
            store.record_promotion(&first).await.unwrap();
            let second = PromotionRow {
                version: "3".into(),
                previous_version: Some("1".into()),
                value: Some(0.75),
                previous_value: Some(0.8),
                forced: true,
                uid: 1001,
                user_name: "alice".into(),
                at_us: first.at_us + 1,
                ..first.clone()
            };
            store.record_promotion(&second).await.unwrap();
            let other = PromotionRow { model: "other".into(), metric: None, value: None, threshold: None, ..first.clone() };
            store.record_promotion(&other).await.unwrap();
            assert_eq!(store.promoted_versions().await.unwrap(), vec![other.clone(), second.clone()], "{:?}", store.backend());
            assert_eq!(store.promotions("smollm").await.unwrap(), vec![second, first], "{:?}", store.backend());
        }
    }
}
