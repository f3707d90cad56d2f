//! The admin endpoints, behind `--admin-key`: the running plan with its predicted and
//! measured TPOT (`GET /admin/plan`), the cluster's device profiles (`GET /admin/cluster`),
//! a re-plan on demand (`POST /admin/replan`), which the ring runs the next time the
//! queue is idle, and what a plan with a device added or removed would be
//! (`POST /admin/what-if`), which adopts nothing.

use std::sync::Arc;
use std::time::Duration;

use axum::body::Bytes;
use axum::extract::{Request, State};
use axum::http::StatusCode;
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::json;

use super::{bearer_is, ApiError, AppState};
use crate::runtime::views::{streams_rate, ClusterView, PlanView};

/// How long `POST /admin/replan` waits for the ring to be idle and finish; after that it
/// answers 202 and the re-plan still runs at the next idle moment.
const REPLAN_WAIT: Duration = Duration::from_secs(60);

pub async fn require_admin_key(State(state): State<Arc<AppState>>, req: Request, next: Next) -> Response {
    match &state.admin_key {
        None => ApiError::AdminDisabled.into_response(),
        Some(key) if !bearer_is(&req, key) => ApiError::AdminUnauthorized.into_response(),
        Some(_) => next.run(req).await,
    }
}

pub async fn plan(State(state): State<Arc<AppState>>) -> Json<PlanView> {
    Json(state.runtime.plan())
}

pub async fn cluster(State(state): State<Arc<AppState>>) -> Json<ClusterView> {
    Json(state.runtime.cluster())
}

pub async fn what_if(State(state): State<Arc<AppState>>, body: Bytes) -> Result<Json<openapi::WhatIfAnswer>, ApiError> {
    let body: openapi::WhatIfRequest = if body.iter().all(u8::is_ascii_whitespace) {
        openapi::WhatIfRequest::default()
    } else {
        serde_json::from_slice(&body).map_err(|e| ApiError::InvalidJson(format!("invalid JSON body: {e}")))?
    };
    let strategy = body.strategy.map(|s| s.parse()).transpose().map_err(|e: String| ApiError::InvalidParameter { param: Some("strategy".into()), message: e })?;
    let runtime = state.runtime.clone();
    // Integer programs: off the async workers.
    let v = tokio::task::spawn_blocking(move || runtime.what_if(&body.without, &body.copies, strategy)).await.map_err(|e| ApiError::Internal(format!("the what-if solve failed: {e}")))??;
    let (s, n) = (&v.schedule, |x: usize| x as u64);
    let members = s
        .members
        .iter()
        .enumerate()
        .map(|(i, &m)| openapi::WhatIfMember {
            name: v.devices[m].name.clone(),
            layers: n(s.plan.devices[i].window * s.plan.rounds()),
            gpu_layers: n(s.plan.devices[i].gpu_layers * s.plan.rounds()),
            windows: s.plan.windows_of(i).iter().map(|r| [n(r.start), n(r.end)]).collect(),
        })
        .collect();
    Ok(Json(openapi::WhatIfAnswer {
        strategy: s.strategy.to_string(),
        members,
        dropped: s.dropped.iter().map(|&d| v.devices[d].name.clone()).collect(),
        rounds: n(s.plan.rounds()),
        predicted_tpot_ms: s.prediction.tpot_s * 1e3,
        micro_batches: n(v.forecast.micro_batches),
        forecast_tokens_per_s: streams_rate(Some(&v.forecast)),
        current_predicted_tpot_ms: v.current.predicted_tpot_ms,
        current_forecast_tokens_per_s: streams_rate(v.current.forecast.as_ref()),
    }))
}

pub async fn replan(State(state): State<Arc<AppState>>, body: Bytes) -> Result<Response, ApiError> {
    let body: openapi::ReplanRequest = if body.iter().all(u8::is_ascii_whitespace) {
        openapi::ReplanRequest::default()
    } else {
        serde_json::from_slice(&body).map_err(|e| ApiError::InvalidJson(format!("invalid JSON body: {e}")))?
    };
    let strategy = body.strategy.map(|s| s.parse()).transpose().map_err(|e: String| ApiError::InvalidParameter { param: Some("strategy".into()), message: e })?;
    let answer = state.runtime.replan(strategy)?;
    match tokio::time::timeout(REPLAN_WAIT, answer).await {
        Ok(Ok(Ok(view))) => match view.last_check.as_ref().and_then(|c| c.fetching.clone()) {
            // Asked for and chosen, but not running yet: not an answer to give as a 200.
            Some(progress) => Ok((StatusCode::ACCEPTED, Json(json!({"status": "fetching", "message": format!("the new plan is adopted once its workers have fetched their windows from the head: {progress} (see GET /admin/plan)"), "plan": view})))
                .into_response()),
            None => Ok(Json(view).into_response()),
        },
        Ok(Ok(Err(e))) => Err(e.into()),
        Ok(Err(_)) => Err(ApiError::ShuttingDown),
        Err(_) => Ok((StatusCode::ACCEPTED, Json(json!({"status": "pending", "message": "the server is busy; the re-plan runs when the queue is next idle (see GET /admin/plan)"})))
            .into_response()),
    }
}
