//! Engine release numbers, for the rules that changed between releases.

use std::fmt;
use std::str::FromStr;

use super::HashError;

/// A release number such as `0.32.0`, `0.14` or `0.4.6.post5` (suffixes are ignored).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct EngineVersion {
    /// Major number.
    pub major: u32,
    /// Minor number.
    pub minor: u32,
    /// Patch number (0 when absent).
    pub patch: u32,
}

impl EngineVersion {
    /// A version from its three numbers.
    pub const fn new(major: u32, minor: u32, patch: u32) -> Self {
        Self { major, minor, patch }
    }
}

impl fmt::Display for EngineVersion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}.{}.{}", self.major, self.minor, self.patch)
    }
}

impl FromStr for EngineVersion {
    type Err = HashError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let bad = || HashError::InvalidVersion(s.to_string());
        let trimmed = s.trim().trim_start_matches('v');
        let mut nums = [0u32; 3];
        let mut count = 0;
        for part in trimmed.split('.').take(3) {
            let digits: String = part.chars().take_while(char::is_ascii_digit).collect();
            if digits.is_empty() {
                break;
            }
            nums[count] = digits.parse().map_err(|_| bad())?;
            count += 1;
            if digits.len() != part.len() {
                break; // a suffix such as "0rc1" ends the number
            }
        }
        if count < 2 {
            return Err(bad());
        }
        Ok(Self::new(nums[0], nums[1], nums[2]))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_release_strings() {
        assert_eq!("0.32.0".parse::<EngineVersion>().unwrap(), EngineVersion::new(0, 32, 0));
        assert_eq!("0.14".parse::<EngineVersion>().unwrap(), EngineVersion::new(0, 14, 0));
        assert_eq!("0.4.6.post5".parse::<EngineVersion>().unwrap(), EngineVersion::new(0, 4, 6));
        assert_eq!("0.11.1rc2".parse::<EngineVersion>().unwrap(), EngineVersion::new(0, 11, 1));
        assert!("vllm".parse::<EngineVersion>().is_err());
        assert!("1".parse::<EngineVersion>().is_err());
    }
}
