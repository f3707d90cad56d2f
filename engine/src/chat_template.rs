//! The model's own chat template (`tokenizer.chat_template`, Jinja) rendered with
//! minijinja, as Hugging Face and llama-server `--jinja` do. llama.cpp's built-in
//! template heuristics are not used: they drop template logic such as SmolLM2's default
//! system prompt.

use minijinja::{Environment, ErrorKind, Value};

use crate::{Error, Result};

pub struct ChatTemplate {
    env: Environment<'static>,
    bos: String,
    eos: String,
}

const TEMPLATE_NAME: &str = "chat";

impl ChatTemplate {
    pub fn new(source: &str, bos: &str, eos: &str) -> Result<ChatTemplate> {
        let mut env = Environment::new();
        // HF templates call Python string methods (.strip(), .startswith(), ...).
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", |msg: String| -> std::result::Result<Value, minijinja::Error> {
            Err(minijinja::Error::new(ErrorKind::InvalidOperation, msg))
        });
        env.add_function("strftime_now", |fmt: String| -> String { strftime_now(&fmt) });
        env.add_template_owned(TEMPLATE_NAME, source.to_string()).map_err(|e| Error::ChatTemplate(format!("cannot parse the template: {e}")))?;
        Ok(ChatTemplate { env, bos: bos.to_string(), eos: eos.to_string() })
    }

    /// Renders `messages` (OpenAI-shaped JSON objects) and optional tool definitions.
    pub fn render(&self, messages: &[serde_json::Value], tools: Option<&serde_json::Value>, add_generation_prompt: bool) -> Result<String> {
        let tmpl = self.env.get_template(TEMPLATE_NAME).map_err(|e| Error::ChatTemplate(e.to_string()))?;
        let ctx = minijinja::context! {
            messages => Value::from_serialize(messages),
            tools => tools.map(Value::from_serialize),
            add_generation_prompt => add_generation_prompt,
            bos_token => self.bos.as_str(),
            eos_token => self.eos.as_str(),
        };
        tmpl.render(ctx).map_err(|e| Error::ChatTemplate(format!("rendering failed: {e}")))
    }
}

/// Templates that print today's date ask for it through `strftime_now`; only the common
/// conversions are supported (UTC).
fn strftime_now(fmt: &str) -> String {
    let secs = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs()) as i64;
    let (y, m, d) = civil_from_days(secs.div_euclid(86_400));
    const MONTHS: [&str; 12] = ["January", "February", "March", "April", "May", "June", "July", "August", "September", "October", "November", "December"];
    fmt.replace("%Y", &y.to_string())
        .replace("%m", &format!("{m:02}"))
        .replace("%d", &format!("{d:02}"))
        .replace("%B", MONTHS[(m - 1) as usize])
        .replace("%b", &MONTHS[(m - 1) as usize][..3])
}

/// Days since 1970-01-01 to (year, month, day), Howard Hinnant's algorithm.
fn civil_from_days(z: i64) -> (i64, i64, i64) {
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    (yoe + era * 400 + i64::from(m <= 2), m, d)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn renders_chatml_with_python_methods_and_exceptions() {
        let src = "{% for m in messages %}{% if m.role == 'bad' %}{{ raise_exception('no') }}{% endif %}<|im_start|>{{ m.role }}\n{{ m.content | trim }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}{{ 'x'.upper() }}";
        let t = ChatTemplate::new(src, "", "<|im_end|>").unwrap();
        let out = t.render(&[json!({"role": "user", "content": " hi "})], None, true).unwrap();
        assert_eq!(out, "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nX");
        let err = t.render(&[json!({"role": "bad", "content": ""})], None, false).unwrap_err();
        assert!(err.to_string().contains("no"), "{err}");
    }

    #[test]
    fn dates_convert() {
        assert_eq!(civil_from_days(0), (1970, 1, 1));
        assert_eq!(civil_from_days(20_779), (2026, 11, 22));
    }
}
